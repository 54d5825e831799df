"""State migration: the restorer's transfers, run round by round.

A layer's state (parameters and optimizer state) is packed into bytes, identical on every
replica, so a layer may be split across several senders: each transfer sends the total
length, then its slice of the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from chameleon_ft.runtime.worker.comm import Comm
from chameleon_ft.runtime.workload.optim import LayerTrainState

MIGRATION_TAG = 1_000_000_000

Transfer = list[int]
"""``[layer, src, dst, part, num_parts]``."""


class Migration:
    """One worker's part of a migration.

    Args:
        comm: the generation's communication.
        device: where the byte buffers live for the transfers.
        layers: the states this worker holds (a sender's source; a receiver's result).
        rebuild: ``(layer, bytes) -> LayerTrainState`` for a received layer.
        first: called once, at the first transfer (where injected faults fire).
    """

    def __init__(self, comm: Comm, device: torch.device, layers: dict[int, LayerTrainState],
                 rebuild: Callable[[int, bytes], LayerTrainState],
                 first: Callable[[], None]) -> None:
        self.comm, self.device, self.layers = comm, device, layers
        self.rebuild, self.first = rebuild, first
        self.packed: dict[int, torch.Tensor] = {}
        self.parts: dict[int, dict[int, torch.Tensor]] = {}
        self.totals: dict[int, int] = {}
        self.started = False

    def run(self, transfers: list[Transfer], rounds: list[list[int]]) -> None:
        """Every round's transfers that involve this worker, then rebuild what arrived."""
        for rnd in rounds:
            works: list[tuple[Any, int, Any]] = []
            for index in rnd:
                layer, src, dst, part, num_parts = transfers[index]
                tag = MIGRATION_TAG + 2 * index
                if src == self.comm.me:
                    works += self._send(layer, dst, part, num_parts, tag)
                elif dst == self.comm.me:
                    works += self._receive(layer, src, part, num_parts, tag)
                else:
                    continue
                if not self.started:
                    self.started = True
                    self.first()
            for work, peer, _ in works:
                self.comm.wait(work, peer, "migration")
        expected = {t[0]: t[4] for t in transfers if t[2] == self.comm.me}
        for layer, num_parts in expected.items():
            got = self.parts.get(layer, {})
            assert len(got) == num_parts, f"layer {layer}: {len(got)} of {num_parts} parts"
            data = torch.cat([got[p].cpu() for p in range(num_parts)])
            self.layers[layer] = self.rebuild(layer, data.numpy().tobytes())

    def _send(self, layer: int, dst: int, part: int, num_parts: int,
              tag: int) -> list[tuple[Any, int, Any]]:
        if layer not in self.packed:
            raw = self.layers[layer].to_bytes()
            self.packed[layer] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        data = self.packed[layer]
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        piece = torch.tensor_split(data, num_parts)[part].contiguous().to(self.device)
        return [(self.comm.send(size, dst, tag), dst, size),
                (self.comm.send(piece, dst, tag + 1), dst, piece)]

    def _receive(self, layer: int, src: int, part: int, num_parts: int,
                 tag: int) -> list[tuple[Any, int, Any]]:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.comm.recv(size, src, tag, "migration size")
        total = int(size.item())
        if self.totals.setdefault(layer, total) != total:
            raise RuntimeError(f"layer {layer}: replicas disagree on the size of its state")
        length = torch.tensor_split(torch.empty(total, dtype=torch.uint8),
                                    num_parts)[part].numel()
        buf = torch.empty(length, dtype=torch.uint8, device=self.device)
        self.parts.setdefault(layer, {})[part] = buf
        return [(self.comm.post_recv(buf, src, tag + 1, "migration"), src, buf)]
