"""The scheduler: which requests run how many tokens on which KV blocks, step by step.

Data flow: the engine adds `Request`s; `Scheduler.schedule()` returns a
`SchedulerOutput` (new requests in full, running ones as block-table deltas,
CoW block copies, finished ids); the runner answers with a
`ModelRunnerOutput` (sampled tokens); `Scheduler.update_from_output()`
appends them, applies the stop rules and returns one `EngineCoreOutput` per
request that advanced. Pure Python: imports no torch.

Modules: `scheduler` (the loop), `step_plan` (one step's decisions and the
output built from them), `update` (applying outputs), `stop` (stop rules),
`preemption`, `request_queue` (FCFS / priority), `deferred_free` (fences
for async scheduling), `admission` (what fits the pool), `pause`, `stats`,
`output` (the messages).
"""
