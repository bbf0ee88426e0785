"""Commands over the layers below: the data tools run ahead of a launch (data: prepare|stats), the
ablations behind the recipe (ablations), plots and a summary of a run (report; python -m
dflash.report), throughput tables (throughput).

May import: any layer. Nothing imports a tool.
"""
