"""Checkpointer's `states=` with the data side of a run: a run interrupted mid-epoch and restored
yields exactly the batches the uninterrupted run yields (torchdata's StatefulDataLoader, with and
without its own generator; a plain DataLoader over a sampler that keeps its position), and torch's
own DataLoader, which cannot be resumed, is refused with what to use instead."""

from __future__ import annotations

import pytest
import torch

import ckptkit
from ckptkit.errors import UsageError

stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is in the dev extra")

DATA = list(range(23))  # 8 batches of 3 per epoch, the last one short
EPOCHS, STOP = 3, 11  # interrupted at step 11: in the middle of the second epoch


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loader(own_generator: bool, seed: int):
    generator = torch.Generator().manual_seed(seed) if own_generator else None
    return stateful.StatefulDataLoader(DATA, batch_size=3, shuffle=True, generator=generator)


def _run(loader, ckpt, states, stop: int | None = None, start: int = 0, epoch: int = 0, trained=None) -> list:
    """(batch, the step's own random draw) for each step of a training loop that saves every step
    and seeds the loader's own generator per epoch (as DistributedSampler.set_epoch does)."""
    model, optim = trained or _model()
    seen, step = [], start
    for epoch in range(epoch, EPOCHS):
        if loader.generator is not None:
            loader.generator.manual_seed(100 + epoch)
        for batch in loader:
            step += 1
            seen.append((batch.tolist(), torch.rand(1).item()))  # dropout-like draws share the global RNG
            ckpt.save(step, model, optim, extra={"epoch": epoch}, states=states)
            if step == stop:
                return seen
    return seen


def _interrupted(tmp_path, own_generator: bool) -> tuple[list, list]:
    """(the uninterrupted run, the run cut after STOP and restored as a new process would)."""
    torch.manual_seed(7)
    whole = _run(_loader(own_generator, 1), ckptkit.Checkpointer(str(tmp_path / "whole"), keep=1), {})
    torch.manual_seed(7)
    loader = _loader(own_generator, 1)
    before = _run(loader, ckptkit.Checkpointer(str(tmp_path / "cut"), keep=1), {"data": loader}, stop=STOP)
    torch.manual_seed(12345)  # a new process: another global state, another loader seed
    fresh = _loader(own_generator, 99)
    resumed = ckptkit.Checkpointer(str(tmp_path / "cut"), keep=1)
    model, optim = _model()
    step = resumed.restore(model, optim, states={"data": fresh})
    assert step == STOP
    after = _run(fresh, resumed, {"data": fresh}, start=step, epoch=resumed.extra["epoch"], trained=(model, optim))
    assert len(whole) == EPOCHS * 8
    return whole, before + after


def test_stateful_dataloader_with_its_own_generator_resumes_exactly(tmp_path):
    whole, resumed = _interrupted(tmp_path, own_generator=True)
    assert resumed == whole  # the same batches, and the model's random draws too


def test_a_loader_on_the_global_rng_shifts_the_model_draws(tmp_path):
    """The trap docs/hooks.md warns of: without generator=, the resumed run's new iterator draws
    its seed from the global generator the Checkpointer just put back, so the data comes back the
    same but every later random draw of the model is shifted."""
    whole, resumed = _interrupted(tmp_path, own_generator=False)
    assert [b for b, _ in resumed] == [b for b, _ in whole]
    assert [d for _, d in resumed][:STOP] == [d for _, d in whole][:STOP]
    assert [d for _, d in resumed][STOP:] != [d for _, d in whole][STOP:]


class PositionSampler(torch.utils.data.Sampler):
    """A sampler that keeps its own position (as Megatron's and torchtitan's samplers do)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.position = n, seed, 0, 0

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        while self.position < self.n:
            self.position += 1
            yield order[self.position - 1]
        self.epoch, self.position = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def test_a_sampler_position_resumes_a_plain_dataloader(tmp_path):
    def loader(sampler):  # num_workers=0: the sampler is read as batches are taken, never ahead; its own
        # generator, or each iterator would draw a seed from the global one (the trap of docs/hooks.md)
        return torch.utils.data.DataLoader(DATA, batch_size=3, sampler=sampler, generator=torch.Generator())

    torch.manual_seed(7)
    whole = _run(loader(PositionSampler(len(DATA), 5)), ckptkit.Checkpointer(str(tmp_path / "whole"), keep=1), {})
    torch.manual_seed(7)
    sampler = PositionSampler(len(DATA), 5)
    before = _run(loader(sampler), ckptkit.Checkpointer(str(tmp_path / "cut"), keep=1), {"sampler": sampler}, stop=STOP)
    fresh = PositionSampler(len(DATA), 5)
    resumed = ckptkit.Checkpointer(str(tmp_path / "cut"), keep=1)
    model, optim = _model()
    step = resumed.restore(model, optim, states={"sampler": fresh})
    after = _run(
        loader(fresh), resumed, {"sampler": fresh}, start=step, epoch=resumed.extra["epoch"], trained=(model, optim)
    )
    assert before + after == whole


def test_torch_dataloader_is_refused_with_what_to_use(tmp_path):
    model, optim = _model()
    ckpt = ckptkit.Checkpointer(str(tmp_path / "run"))
    loader = torch.utils.data.DataLoader(DATA, batch_size=3, shuffle=True)
    with pytest.raises(UsageError, match=r"states\['data'\]: torch's DataLoader .* StatefulDataLoader"):
        ckpt.save(1, model, optim, states={"data": loader})
    with pytest.raises(UsageError, match="StatefulDataLoader"):
        ckpt.restore(model, optim, states={"data": loader})
    assert ckpt.steps() == []  # nothing written
