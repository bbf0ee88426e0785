"""Helpers every layer may use: durable file operations (files), the flag parser of every command
and ConfigError (cli), the device and log set-up (runtime), the step-phase clock (phases), a
launch's ranks and their bounded syncs (ranks).

May import: nothing of dflash.
"""
