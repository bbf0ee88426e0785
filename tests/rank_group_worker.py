"""One rank of a RankGroup (tests/unit/util/test_ranks.py), started without a launcher: the ranks
sync at start-up, then rank 1 finishes, dies or stalls as told, and each rank prints what its
report gave or raised."""

import os
import sys
import time

from dflash.util.ranks import PeerError, RankGroup, launched

mode, timeout_s = sys.argv[1], float(sys.argv[2])
with RankGroup(launched(), timeout_s, "--peer-timeout-s") as group:
    greeting = group.from_main(lambda: "hello from rank 0", "starting")
    group.open_reports(2)
    if group.launch.rank == 1 and mode == "die":
        os._exit(9)
    if group.launch.rank == 1 and mode == "stall":
        time.sleep(10 * timeout_s)
    try:
        print(greeting, group.report([group.launch.rank, 10 * group.launch.rank], "finishing"), flush=True)
    except PeerError as err:
        print(f"PeerError naming rank {err.rank}: {err}", flush=True)
        sys.exit(1)
