"""Helpers every layer may use: durable file operations (files), the flag parser of every command
and ConfigError (cli), the device and log set-up (runtime), the step-phase clock (phases).

May import: nothing of dflash.
"""
