"""One prepared device run (``benchmarks/device/run.sh``): environment, the GPU tests,
attention kernels, a ~1B Llama's train step, decoding and serving, each section
time-boxed in its own process, results written after every section (``README.md`` here).

Modules: ``run`` (the driver: sections, deadlines, reports), ``section`` (one section in a
child process), ``common`` (result sink, shapes, timing helpers), ``env`` (environment and
tests), ``kernels`` (attention), ``models`` (train step, decode, serving), ``report``
(JSON and markdown).
"""
