"""Which host each rank of a group runs on, gathered once per group.

Start-up needs it three times (the node size in backend.py, the internode transport in
paths/internode.py, NVSHMEM's transport in nvshmem.py); the answer cannot change while the group
lives, so the first call gathers and the later ones read the cache. Every rank reaches these
calls at the same points of start-up (each is collective), so every rank finds the cache filled
at the same call and none of them waits in a gather the others skip. The cache holds the group
weakly: a destroyed and re-created group is gathered anew.
"""

from __future__ import annotations

import socket
import weakref
from typing import List

import torch.distributed as dist

from .collectives import gather

_hosts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def host_names(group) -> List[str]:
    """Each rank's host name in group rank order (None: the default group); collective over
    `group` the first time."""
    if group is None:
        group = dist.group.WORLD
    if group not in _hosts:
        _hosts[group] = gather(socket.gethostname(), group)
    return list(_hosts[group])
