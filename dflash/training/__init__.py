"""The training run: the run itself (run), a drafter rank's setup (drafter_setup), its shard
(shard), LR and noise schedules (schedules), the time budget (budget), the spike guard (spike),
checkpoints (checkpoint), metrics and what a rank reports (metrics, run_report, profiling), the
memory model (memory), the line a rank gives when it lost a peer (peer_loss).

May import: every layer below (util, target, data, demo, drafter, placement, config, eval).
"""
