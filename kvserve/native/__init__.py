"""The one place Python meets C: the native CPU kernels' sources (csrc/), how they are
built and loaded (`build`), the declared interface (`abi`), their Python wrappers
(`cpu_kernels`) and the switches that choose them (`config.KernelConfig`).

Importing the package builds nothing and needs no torch; the model, the worker and
the grammar mask import it, and it imports nothing above `kvserve.config`.
"""
