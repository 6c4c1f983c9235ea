"""A load-balanced group call in flight: chunks handed to replicas as they finish (the Ray part).

:class:`BalancedGroupCall` is what :meth:`WorkerGroup` methods return (through ``submit``) for a
``DP_SPLIT`` call whose batch carries a :class:`~verity.controller.load_balance.LoadBalanceRequest`
(the module docstring there says what it does). A driver thread keeps every replica fed while
the caller goes on (``trainer.mode=async`` submits a generation and trains meanwhile);
:meth:`BalancedGroupCall.result` waits for it. Each Ray actor runs its calls in order, so the
``in_flight`` chunks of a replica queue there, and the ranks of a tensor-parallel replica receive
the same chunks in the same order.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from verity.batch import Batch
from verity.batch.transport import DRIVER_TRANSFERS
from verity.controller.dispatch import Dispatch, MethodSpec, _check_batch, registered_methods
from verity.controller.errors import DispatchError, WorkerTimeoutError
from verity.controller.load_balance import (
    CHUNK_INDEX_META,
    CHUNK_SEED_META,
    LOAD_BALANCE_META,
    LoadBalanceRequest,
    chunk_bounds,
    chunk_seed,
    replica_ranks,
)

if TYPE_CHECKING:
    from verity.controller.worker_group import WorkerGroup

__all__ = ["ROWS_PER_REPLICA_META", "BalancedGroupCall", "load_balance_request"]

ROWS_PER_REPLICA_META = "rows_per_replica"  # the answer's meta: rows each replica generated, by replica


def load_balance_request(args: tuple, kwargs: dict) -> tuple[LoadBalanceRequest | None, Batch | None]:
    """The call's :class:`LoadBalanceRequest` and the one batch it cuts, or ``(None, None)``.

    Raises DispatchError when a request comes with other than exactly one Batch argument.
    """
    batches = [a for a in (*args, *kwargs.values()) if isinstance(a, Batch)]
    requests = [b.meta[LOAD_BALANCE_META] for b in batches if LOAD_BALANCE_META in b.meta]
    if not requests:
        return None, None
    if len(batches) != 1 or kwargs:
        raise DispatchError("a load-balanced call takes exactly one Batch argument, positional")
    return requests[0], batches[0]


class BalancedGroupCall:
    """One load-balanced call of ``role.method`` over ``batch`` (see the module docstring)."""

    def __init__(
        self,
        group: WorkerGroup,
        role: str,
        method: str,
        spec: MethodSpec,
        batch: Batch,
        request: LoadBalanceRequest,
    ) -> None:
        self._group, self._role, self._method, self._spec = group, role, method, spec
        layouts = [layout.layout_for(spec.layout) for layout in group._layouts[role]]
        self.replicas = replica_ranks([lay.dp_rank for lay in layouts], [lay.is_collector for lay in layouts])
        rows = len(batch)
        if batch.pad_rows:
            raise DispatchError(
                f"{group._label(role, method)}: a load-balanced batch must carry no padding rows"
            )
        groups = batch[request.group_key] if request.group_key in batch.tensor_keys() else None
        size = request.rows_per_chunk(rows, len(self.replicas))
        self.bounds = chunk_bounds(groups, rows, size)
        self.rows_per_replica = [0] * len(self.replicas)
        self._request = request
        self._batch = batch
        self._answers: list[Any] = [None] * len(self.bounds)
        self._error: BaseException | None = None
        self._value: Any = None
        self._done = False
        self._thread = threading.Thread(target=self._run, name=f"balanced-{method}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the driver thread
    def _chunk(self, index: int) -> Batch:
        start, end = self.bounds[index]
        part = self._batch.index(slice(start, end))
        part.meta.pop(LOAD_BALANCE_META, None)
        part.meta[CHUNK_INDEX_META] = index
        if "seed" in part.meta:
            part.meta[CHUNK_SEED_META] = chunk_seed(part.meta["seed"], index)
        return part

    def _broadcast(self, name: str | None) -> None:
        """Call the role's method ``name`` on every rank and wait (skipped when the role has none)."""
        if name is None:
            return
        spec = registered_methods(self._group._role_classes[self._role]).get(name)
        if spec is None:
            return
        if spec.dispatch is not Dispatch.BROADCAST:
            raise DispatchError(
                f"{self._group._label(self._role, name)}: a load-balanced call's hook must be BROADCAST"
            )
        self._group._submit(self._role, name, spec, (), {}).result()

    def _send(self, index: int, replica: int) -> list:
        import ray

        chunk = self._chunk(index)
        ranks, collector = self.replicas[replica]
        payload = ray.put(chunk) if len(ranks) > 1 else chunk
        DRIVER_TRANSFERS.add(sent=((chunk,), {}))
        hosts = self._group._hosts
        return [hosts[r].call.remote(self._role, self._method, r == collector, payload) for r in ranks]

    def _run(self) -> None:
        import ray

        try:
            self._broadcast(self._request.before)
            waiting = list(range(len(self.bounds)))
            flying: dict[int, tuple[int, list]] = {}  # chunk -> (replica, refs)
            for _ in range(self._request.in_flight):
                for replica in range(len(self.replicas)):
                    if waiting:
                        index = waiting.pop(0)
                        flying[index] = (replica, self._send(index, replica))
            while flying:
                every = [ref for _, refs in flying.values() for ref in refs]
                ray.wait(every, num_returns=1)
                for index in sorted(flying):
                    replica, refs = flying[index]
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                    if len(ready) < len(refs):
                        continue
                    del flying[index]
                    self._collect(index, replica, refs)
                    if waiting:
                        following = waiting.pop(0)
                        flying[following] = (replica, self._send(following, replica))
            self._broadcast(self._request.after)
        except BaseException as err:  # handed to result() in the caller's thread
            self._error = err

    def _collect(self, index: int, replica: int, refs: list) -> None:
        ranks, collector = self.replicas[replica]
        group = self._group
        answers = group._gather(refs, ranks, self._role, self._method, None)  # ready: raises explained errors
        DRIVER_TRANSFERS.add(received=[answers[collector][0]])
        for rank, (_, layout) in answers.items():
            group._layouts[self._role][rank] = layout
        answer = answers[collector][0]
        start, end = self.bounds[index]
        if not isinstance(answer, Batch) or len(answer) != end - start:
            got = f"{len(answer)} rows" if isinstance(answer, Batch) else type(answer).__name__
            raise DispatchError(
                f"{group._label(self._role, self._method)}: a load-balanced call must answer a Batch of one row "
                f"per row sent; replica {replica} answered {got} for {end - start} rows"
            )
        self._answers[index] = answer
        self.rows_per_replica[replica] += end - start

    # ------------------------------------------------------------------ the caller's side
    def result(self, timeout_s: float | None = None) -> Batch:
        """Wait for every chunk (at most ``timeout_s``, default the group's call timeout); the answers
        joined in the batch's order, ``meta["rows_per_replica"]`` added."""
        if self._done:
            return self._value
        timeout_s = timeout_s or self._group.call_timeout_s
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WorkerTimeoutError(
                f"{self._group._label(self._role, self._method)}: the load-balanced call did not finish "
                f"within {timeout_s:g} s",
                group=self._group.name,
                role=self._role,
                method=self._method,
                rank=self.replicas[0][1],
            )
        if self._error is not None:
            raise self._error
        joined = Batch.concat(self._answers)
        if self._spec.check_schema:
            _check_batch(self._group._label(self._role, self._method), "returned batch", joined)
        for key in (CHUNK_INDEX_META, CHUNK_SEED_META):
            joined.meta.pop(key, None)
        joined.meta[ROWS_PER_REPLICA_META] = list(self.rows_per_replica)
        self._value, self._done = joined, True
        return joined
