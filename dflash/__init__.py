"""DFlash drafter training, by concern. Layers, lowest first: a module imports its own subpackage
and the layers below it, never one above; no library module imports a command (a module run with
python -m); the imports have no circle (tests/unit/test_layout.py checks all three).

  util        durable files, the flag parser and ConfigError, device and log set-up, the phase clock
  nn          the transformer math both models run: rotary embedding, RMSNorm, GQA attention
  demo        where the demo target and data are (assets/demo/), and the commands that built them
  target      the frozen target: layer hooks, GGUF conversion, static KV cache + CUDA graphs, batches
  data        chat formats, tokenization, shard preparation, dataset, sampler, ShareGPT, regeneration
  drafter     the drafter: model, attention, objective, step, export, the FLOP model
  placement   process groups, topology (which rank runs what), feature sources, the transport
  config.py   the run's typed flags: recipe and demo defaults, every check
  eval        speculative decoding, tau and the lossless check, the periodic exact tau
  training    the run: setup, loop, schedules, spike guard, checkpoints, metrics, the memory model
  benchmarks, tools   commands over everything above; nothing imports them

Commands: python -m dflash.training | dflash.eval | dflash.data | dflash.regenerate | dflash.report,
installed as dflash-train, dflash-eval, ... (pyproject.toml; regenerate.py and report.py here are
aliases of dflash/data/regenerate.py and dflash/tools/report.py). A package's __main__.py is a
command: it may import any layer.
"""
