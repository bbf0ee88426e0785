"""Feature transport for split placement: target ranks run the frozen target, drafter ranks
train on what they send back, one micro-batch per request.

wire     the spec, the message layouts, the FeatureBatch type
link     per-pair channels (gloo control, NCCL or gloo data) and bounded waits
routing  which target gets the next request (a pure rule)
client   the drafter side: submit ahead, receive in step order
server   the target side: serve requests with the frozen target
"""

from dflash.placement.transport.client import DrafterClient
from dflash.placement.transport.link import PairGroups, open_pair_groups
from dflash.placement.transport.server import ServeStats, TargetServer
from dflash.placement.transport.wire import FeatureBatch, TransportError, TransportSpec

__all__ = ["DrafterClient", "FeatureBatch", "PairGroups", "ServeStats", "TargetServer", "TransportError",
           "TransportSpec", "open_pair_groups"]
