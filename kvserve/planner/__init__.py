"""The capacity planner behind `kvserve plan`: replicas, TP size and KV memory for a load
and an SLO. `plan` replays a trace (`trace`) through the real scheduler on a simulated
clock (`simulated`) with a step-cost model (the roofline, or one measured on a running
server: `calibrate`; at TP > 1 plus the collectives over a measured link, `interconnect`,
and what a `-tp N` server cost beyond them, `tp_cost`); `cli` is the command."""
