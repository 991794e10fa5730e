"""The substitutions that let LMDeploy's PyTorch engine and Mooncake transport run without a GPU.

Each function takes the module it substitutes in (already imported) and replaces only hardware-bound
pieces: CUDA streams/events, the ops backend, the KV pool's device, host→device copies, the model, and
Mooncake's NIC discovery. Everything else (engine, scheduler, migration, transfers) stays LMDeploy's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from types import ModuleType
from typing import Any

import torch

from lmdeploy_pdfix_sim import faults, forward, settings, state

_FAKE_FREE_MEM = 8 << 30
_LOOPBACK = '127.0.0.1'


class _SimStream:
    """Stands in for torch.cuda.Stream: CPU work is synchronous, so ordering is already guaranteed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _SimEvent:
        return event or _SimEvent()

    def query(self) -> bool:
        return True


class _SimEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


# CacheEngine asserts its own stream differs from the current one, so the current stream is a singleton.
_CURRENT_STREAM = _SimStream()


def _noop():
    """A fresh no-op per attribute: torch._dynamo rejects one object standing for several torch functions."""

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    return noop


def install_cuda_shims(torch_module: ModuleType) -> None:
    cuda = torch_module.cuda
    cuda.Stream = _SimStream
    cuda.Event = _SimEvent
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.current_stream = lambda device=None: _CURRENT_STREAM
    cuda.default_stream = lambda device=None: _CURRENT_STREAM
    cuda.synchronize = _noop()
    cuda.empty_cache = _noop()
    cuda.set_device = _noop()
    cuda.current_device = lambda: 0
    cuda.mem_get_info = lambda device=None: (_FAKE_FREE_MEM, _FAKE_FREE_MEM)
    torch_module._C._cuda_clearCublasWorkspaces = _noop()


def substitute_backend_selector(selector: ModuleType) -> None:
    """Keep LMDeploy's CUDA KV layout but take every layer implementation from the torch-only backend."""
    from lmdeploy.pytorch.backends.default import DefaultOpsBackend

    original = selector._get_backend

    @functools.wraps(original)
    def _get_backend():
        from lmdeploy.pytorch.devices import get_device_manager

        if get_device_manager().current_context().device_type == 'cuda':
            return DefaultOpsBackend
        return original()

    selector._get_backend = _get_backend


def _on_host(allocate):
    """Wrap an allocator so the canonical 'cuda' device becomes the host ('meta' sizing passes through)."""

    @functools.wraps(allocate)
    def allocate_on_host(*args: Any, **kwargs: Any):
        if kwargs.get('device') in ('cuda', torch.device('cuda')):
            kwargs['device'] = 'cpu'
        return allocate(*args, **kwargs)

    return allocate_on_host


def substitute_cache_allocation(cache_engine: ModuleType) -> None:
    """The KV pool (and the state pool) live in host memory, which Mooncake registers as is."""
    if hasattr(cache_engine.CacheEngine, 'allocate_caches'):  # 0.17: one module, allocators on the classes
        for cls in (cache_engine.CacheEngine, cache_engine.StateCacheEngine):
            # getattr unwraps the classmethod into a bound function; staticmethod of the wrapper keeps that binding.
            cls.allocate_caches = staticmethod(_on_host(cls.allocate_caches))
        return
    # 0.18: a package; the block-cache plan and the state allocator take the device.
    from lmdeploy.pytorch.engine.cache_engine import plan, state

    plan.BlockCachePlan.allocate = _on_host(plan.BlockCachePlan.allocate)
    state._allocate_state_caches = _on_host(state._allocate_state_caches)


def substitute_block_count(executor_base: ModuleType) -> None:
    """An explicit block count makes leaks and exhaustion reproducible (there is no GPU memory to size from)."""
    original = executor_base.ExecutorBase.update_configs

    @functools.wraps(original)
    def update_configs(self) -> None:
        blocks = settings.num_blocks()
        if blocks and not self.cache_config.num_gpu_blocks:
            self.cache_config.num_gpu_blocks = blocks
        original(self)

    executor_base.ExecutorBase.update_configs = update_configs


def _to_host(val: Any, non_blocking: bool = False) -> Any:
    """Like LMDeploy's _try_to_cuda, on the CPU: `to_device` has side effects (e.g. fill_tensors) it needs."""
    if val is None or isinstance(val, torch.Tensor):
        return val
    if hasattr(val, 'to_device'):
        return val.to_device('cpu', non_blocking=non_blocking)
    raise RuntimeError(f'Can not move {type(val)} to the host.')


def substitute_model_agent(agent: ModuleType) -> None:
    agent._try_to_cuda = _to_host
    cls = agent.BaseModelAgent

    def build_model(self) -> None:
        self.patched_model = forward.SimModel(self.model_config.vocab_size, self.model_config.hidden_size)
        self.build_model_ctx = None

    async def async_forward(self, inputs, cache_inputs=None) -> dict:
        if not inputs.is_dummy and forward.kind(inputs) == 'prefill':
            # a slow forward awaits, as LMDeploy awaits a GPU: the engine keeps taking requests meanwhile
            await asyncio.sleep(float(faults.take(faults.SLOW_PREFILL) or 0))
        return forward.run(inputs, self.cache_engine, self.model_config.hidden_size)

    cls._build_model = build_model
    cls.build_model = build_model
    cls.build_graph_runner = lambda self: None
    cls.get_free_mem = lambda self: _FAKE_FREE_MEM
    cls.async_forward = async_forward


def _initialize_tcp_p2p(self, init_request) -> None:
    """Mooncake over TCP on loopback; LMDeploy hard-codes RDMA and a NIC name."""
    result = self.engine.initialize(_LOOPBACK, 'P2PHANDSHAKE', 'tcp', '')
    if result != 0:
        raise RuntimeError(f'Failed to initialize Mooncake engine over TCP: {result}')


def substitute_mooncake(mooncake: ModuleType) -> None:
    mooncake.get_local_ip_by_remote = lambda: _LOOPBACK
    mooncake.get_rdma_nics = lambda: []
    cls = mooncake.MooncakeMigrationManagement
    cls._initialize_p2p = _initialize_tcp_p2p
    original_migrate = cls._migrate

    @functools.wraps(original_migrate)
    def _migrate(self, assignment) -> None:
        nbytes = sum(task.length for task in assignment.batch)
        if faults.take(faults.MIGRATE_ERROR) is not None:
            raise faults.InjectedFault('injected KV transfer failure')
        # blocks the Decode engine's loop, as LMDeploy's synchronous copy does (a worker thread in async mode)
        time.sleep(float(faults.take(faults.SLOW_MIGRATE) or 0))
        if settings.drops_kv():
            # Negative control: the Decode never receives the Prefill's KV, the answer must not match.
            state.count('migrations_dropped')
            return
        original_migrate(self, assignment)
        state.count('migrations')
        state.count('migrated_bytes', nbytes)

    cls._migrate = _migrate


def substitute_migration_schedule(scheduler: ModuleType) -> None:
    cls = scheduler.Scheduler
    name = 'schedule_migration' if hasattr(cls, 'schedule_migration') else '_schedule_migration'  # 0.18 / 0.17
    original = getattr(cls, name)

    @functools.wraps(original)
    def schedule_migration(self):
        if faults.take(faults.MIGRATION_LOOP_END) is not None:
            raise asyncio.CancelledError('injected end of the migration loop')
        return original(self)

    setattr(cls, name, schedule_migration)


def substitute_engine_start(zmq_engine: ModuleType) -> None:
    """A stock node gets the start-up fix of ``engine_start`` too, so that stock clusters start reliably on 2
    loaded cores (about one start in three lost the race); a patched node gets it from that unit itself.
    ``bench_starts`` sets ``LMDEPLOY_PDFIX_SIM_RAW_START`` to measure the race as released."""
    from lmdeploy_pdfix import settings as switches
    from lmdeploy_pdfix.units.engine_start import PATCH

    unit_applies = switches.enabled() and PATCH.name not in switches.disabled_patches()
    if not unit_applies and not settings.raw_start():
        PATCH.apply(zmq_engine)


def substitute_engine_state(engine_module: ModuleType) -> None:
    """Once the engine exists, its process publishes scheduler snapshots for the api_server to serve."""
    original_init = engine_module.Engine.__init__

    @functools.wraps(original_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        state.start_publisher(self)

    engine_module.Engine.__init__ = __init__


def substitute_api_router(api_server: ModuleType) -> None:
    """Adds the read-only state route to the router every api_server app includes."""
    original = api_server.create_openai_router

    @functools.wraps(original)
    def create_openai_router(*args: Any, **kwargs: Any):
        router = original(*args, **kwargs)
        router.add_api_route(state.ROUTE, state.read_endpoint, methods=['GET'])
        return router

    api_server.create_openai_router = create_openai_router

