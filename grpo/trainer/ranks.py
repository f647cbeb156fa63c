"""What the trainer's ranks do together: rank 0 decides and every rank learns the decision, and rank
0's raw message reaches every rank (each decodes and validates it itself: nothing is unpickled)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


def rank_zero_decides(decide: Callable[[], None], device, refused: type[Exception], fallback: str,
                      explained: tuple[type[Exception], ...] = ()) -> None:
    """Run `decide` on rank 0 only; when it raises, every rank raises `refused`: rank 0 with the reason
    (an `explained` exception's own message, any other's type and message), the others with `fallback`
    (rank 0's log says why). The ranks never wait in a collective for a rank that already failed."""
    refusal = ""
    if dist.get_rank() == 0:
        try:
            decide()
        except Exception as e:  # whatever it is, the other ranks must hear of it
            refusal = str(e) if isinstance(e, explained) else f"{type(e).__name__}: {e}"
    flag = torch.tensor([int(bool(refusal))], device=device)
    dist.broadcast(flag, 0)
    if flag.item():
        raise refused(refusal or fallback)


def broadcast_frames(frames: list[bytes] | None, device) -> list[bytes] | None:
    """Rank 0's raw message to every rank, as byte tensors. None from rank 0 means stop, and every
    rank gets None."""
    sizes = torch.tensor([len(f) for f in frames] if frames is not None else [], dtype=torch.long, device=device)
    count = torch.tensor([len(sizes) if frames is not None else -1], dtype=torch.long, device=device)
    dist.broadcast(count, 0)
    if int(count) < 0:
        return None
    if dist.get_rank() != 0:
        sizes = torch.empty(int(count), dtype=torch.long, device=device)
    dist.broadcast(sizes, 0)
    data = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8).to(device) if frames is not None \
        else torch.empty(int(sizes.sum()), dtype=torch.uint8, device=device)
    dist.broadcast(data, 0)
    raw = data.cpu().numpy().tobytes()
    out, start = [], 0
    for n in sizes.tolist():
        out.append(raw[start:start + n])
        start += n
    return out
