"""State migration: the restorer's transfers, run round by round.

A layer's state (parameters and optimizer state) is packed into bytes, identical on every
replica, so a layer may be split across several senders: each transfer sends the total
length, then its slice of the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from chameleon_ft.runtime.traffic import Do, Kind, Message, migration_program
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
        pack: ``(layer, state) -> bytes`` of a layer sent (default: its whole state; at
            ``tp > 1`` this rank's shard, sent to its counterpart rank on its plane).
    """

    def __init__(self, comm: Comm, device: torch.device, layers: dict[int, LayerTrainState],
                 rebuild: Callable[[int, bytes], LayerTrainState],
                 first: Callable[[], None],
                 pack: Callable[[int, LayerTrainState], bytes] | None = None) -> None:
        self.comm, self.device, self.layers = comm, device, layers
        self.rebuild, self.first = rebuild, first
        self.pack = pack or (lambda _layer, state: state.to_bytes())
        self.packed: dict[int, torch.Tensor] = {}
        self.parts: dict[int, dict[int, torch.Tensor]] = {}
        self.totals: dict[int, int] = {}
        self.lengths: dict[Message, tuple[Any, torch.Tensor]] = {}
        """Posted receives of a transfer's length (work, buffer), until waited for."""
        self.started = False

    def run(self, transfers: list[Transfer], rounds: list[list[int]]) -> None:
        """Every round's transfers that involve this worker, then rebuild what arrived.

        Performs this worker's migration program (``runtime.traffic.migration_program``):
        a sender posts a transfer's length then its slice; a receiver posts its receives
        in each sender's order, waiting for a length before it posts the slice it sizes.
        """
        for program in migration_program(transfers, rounds, self.comm.me):
            works: list[tuple[Any, int, Any]] = []
            for ins in program:
                message = ins.message
                if ins.do is Do.WAIT_ALL:
                    for work, peer, _ in works:
                        self.comm.wait(work, peer, "migration")
                    continue
                assert message is not None
                if not self.started:
                    self.started = True
                    self.first()
                if ins.do is Do.POST_SEND:
                    works.append(self._send(message, transfers[message.key[0]][4]))
                elif ins.do is Do.POST_RECV:
                    works += self._post(message, transfers[message.key[0]][4])
                elif ins.do is Do.WAIT_RECV:
                    self._size_arrived(message)
        expected = {t[0]: t[4] for t in transfers if t[2] == self.comm.me}
        for layer, num_parts in expected.items():
            got = self.parts.get(layer, {})
            assert len(got) == num_parts, f"layer {layer}: {len(got)} of {num_parts} parts"
            data = torch.cat([got[p].cpu() for p in range(num_parts)])
            self.layers[layer] = self.rebuild(layer, data.numpy().tobytes())

    def _send(self, message: Message, num_parts: int) -> tuple[Any, int, Any]:
        _, layer, part = message.key
        if layer not in self.packed:
            raw = self.pack(layer, self.layers[layer])
            self.packed[layer] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        data = self.packed[layer]
        if message.kind is Kind.STATE_SIZE:
            out = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        else:
            out = torch.tensor_split(data, num_parts)[part].contiguous().to(self.device)
        return (self.comm.send(out, message.dst, _tag(message)), message.dst, out)

    def _post(self, message: Message, num_parts: int) -> list[tuple[Any, int, Any]]:
        """Post a receive; a length's is waited for by its own instruction, a slice's with
        the round."""
        _, layer, part = message.key
        if message.kind is Kind.STATE_SIZE:
            buf = torch.zeros(1, dtype=torch.int64, device=self.device)
            what = "migration size"
        else:
            total = self.totals[layer]  # its length arrived first (the program's order)
            length = torch.tensor_split(torch.empty(total, dtype=torch.uint8),
                                        num_parts)[part].numel()
            buf = torch.empty(length, dtype=torch.uint8, device=self.device)
            self.parts.setdefault(layer, {})[part] = buf
            what = "migration"
        work = self.comm.post_recv(buf, message.src, _tag(message), what)
        if message.kind is Kind.STATE_SIZE:
            self.lengths[message] = (work, buf)
            return []
        return [(work, message.src, buf)]

    def _size_arrived(self, message: Message) -> None:
        """Wait for a transfer's length; every replica must agree on a layer's."""
        work, buf = self.lengths.pop(message)
        self.comm.wait(work, message.src, "migration size")
        layer = message.key[1]
        total = int(buf.item())
        if self.totals.setdefault(layer, total) != total:
            raise RuntimeError(f"layer {layer}: replicas disagree on the size of its state")


def _tag(message: Message) -> int:
    """Gloo's tag of a migration message (NCCL ignores it; the order makes the match)."""
    return MIGRATION_TAG + 2 * message.key[0] + (message.kind is Kind.STATE_BYTES)
