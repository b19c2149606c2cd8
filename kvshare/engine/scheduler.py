"""Which requests run in the next step: first-come first-served admission (one prefill per step), then decode of
every running request together; when blocks run out, the newest running request is preempted and recomputed later."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvshare.engine.block_manager import BlockManager
from kvshare.engine.sequence import Sequence, Status


@dataclass
class Batch:
    is_prefill: bool
    seqs: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Invariants: a waiting request holds no blocks; a running request's table covers all its tokens after
    schedule(); a prefill batch holds exactly one request, admitted in arrival order."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        # Prefill first (it yields a first token, which is what users wait for); one request per step so running
        # requests keep decoding between admissions.
        if self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.block_manager.can_allocate(seq):
                self.waiting.popleft()
                seq.num_computed = self.block_manager.allocate(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                return Batch(True, [seq])
        batch = Batch(False)
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted in this loop
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.block_manager.may_append(seq)
                batch.seqs.append(seq)
        return batch if batch.seqs else None

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it first: its K/V (prompt and generated so far) is recomputed on admission."""
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the queues (finished or aborted) and drop its hold on its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = Status.FINISHED
