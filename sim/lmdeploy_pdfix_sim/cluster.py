"""Start and stop a GPU-free DistServe cluster: the real ``lmdeploy serve proxy`` and ``api_server`` processes.

Every process runs on 127.0.0.1 in its own process group, with ``LMDEPLOY_PDFIX_SIM=1`` so the start-up hook
substitutes the hardware-bound pieces. ``Cluster.stop`` ends exactly the process groups it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.domain.protocol import bearer
from lmdeploy_pdfix_sim import faults, model
from lmdeploy_pdfix_sim import settings as sim_settings

HOST = '127.0.0.1'
MODEL_NAME = 'pdfix-sim'
STATE_ROUTE = '/distserve/pdfix/sim/state'
_TERM_GRACE_S = 10.0
_REGISTRATION_FAILED = b'Service registration failed'  # api_server's log line when its proxy did not answer
# The cluster's HTTP ports come from below the kernel's ephemeral range (32768-60999) and ZeroMQ's random ports
# (49152-65535), and above Mooncake's handshake ports (about 15000-17000): a port handed out while a node starts
# cannot be taken meanwhile by an engine's RPC socket (seen: a Decode's engine bound the port another Decode
# was about to serve on; that Decode exited with 'address already in use').
_NODE_PORTS = range(20000, 32768)


@dataclass
class ClusterConfig:
    prefill: int = 1
    decode: int = 1
    proxies: int = 1  # replicas of the proxy over the same nodes; every node registers with each (D30)
    hybrid: int = 0  # --role Hybrid nodes of the same model beside the cluster, not registered with its proxy
    stock: bool = False  # LMDEPLOY_PDFIX unset: LMDeploy as released, only the model emulated
    stock_roles: tuple[str, ...] = ()  # roles (Proxy, Prefill, Decode) run stock even when ``stock`` is False
    max_prefill_token_num: int | None = None
    num_blocks: int = 512
    max_batch_size: int = 64  # explicit: LMDeploy's default asks the CUDA device name
    log_dir: Path = Path('.sim/logs')
    model_dir: Path = Path('.sim/model')
    drop_kv_on_decode: bool = False  # negative control: Decode nodes skip the Mooncake read
    python: str = sys.executable
    startup_timeout_s: float = 240.0
    warmup: bool = True  # connect every P/D pair up front, so the first requests do not race the link-up
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every node, e.g. a short orphan TTL
    api_key: str | None = None  # --api-keys of the proxy and every node, and LMDEPLOY_PDFIX_NODE_API_KEY of each
    node_args: tuple[str, ...] = ()  # extra api_server arguments of every node, e.g. --enable-abort-handling
    decode_args: tuple[str, ...] = ()  # extra api_server arguments of Decode nodes only, e.g. another --chat-template


@dataclass
class Process:
    name: str
    role: str  # Proxy, Prefill, Decode or Hybrid
    url: str
    pid: int
    log: str
    state_file: str | None = None
    stopped: bool = False  # stopped by ``stop_node``; ``restart_node`` starts it again on the same port
    frozen: bool = False  # hung by ``freeze`` (SIGSTOP) until ``thaw``


@dataclass
class Cluster:
    config: ClusterConfig
    processes: list[Process] = field(default_factory=list)
    startup_s: float | None = None

    @property
    def proxy_url(self) -> str:
        return self.proxy_urls[0]

    @property
    def proxy_urls(self) -> list[str]:
        return self._urls('Proxy')

    @property
    def prefill_urls(self) -> list[str]:
        return self._urls('Prefill')

    @property
    def decode_urls(self) -> list[str]:
        return self._urls('Decode')

    @property
    def hybrid_urls(self) -> list[str]:
        return self._urls('Hybrid')

    def _urls(self, role: str) -> list[str]:
        return [proc.url for proc in self.processes if proc.role == role]

    def start(self) -> Cluster:
        """Start proxy and nodes, wait until all are healthy and registered; stops everything on failure."""
        began = time.monotonic()
        try:
            self._start_all()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        return self

    def _start_all(self) -> None:
        cfg = self.config
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        model.ensure_model_dir(cfg.model_dir)
        # The nodes start beside the proxy: a node registers only once its engine is built, seconds after the
        # proxy answers; one that still came too early is started again (``_register_late``).
        proxies = [self._spawn(f'proxy{i or ""}', 'Proxy', self._proxy_args) for i in range(cfg.proxies)]
        nodes = [self._spawn(f'prefill{i}', 'Prefill', self._node_args) for i in range(cfg.prefill)]
        nodes += [self._spawn(f'decode{i}', 'Decode', self._node_args) for i in range(cfg.decode)]
        nodes += [self._spawn(f'hybrid{i}', 'Hybrid', self._node_args) for i in range(cfg.hybrid)]
        deadline = time.monotonic() + cfg.startup_timeout_s
        for proxy in proxies:
            wait_http_ok(f'{proxy.url}/nodes/status', deadline, proxy.pid)
        for node in nodes:
            wait_http_ok(f'{node.url}/health', deadline, node.pid)
        self._register_late(deadline)
        self._wait_registered(deadline)
        for proxy in proxies if cfg.warmup else ():
            http_json('POST', f'{proxy.url}/distserve/connection_warmup', {}, timeout=60, headers=self.credentials)

    @property
    def credentials(self) -> dict[str, str]:
        """Headers that pass the cluster's ``--api-keys`` (none when it has none)."""
        return bearer(self.config.api_key)

    def _keys(self) -> list[str]:
        return ['--api-keys', self.config.api_key] if self.config.api_key else []

    def _proxy_args(self, port: int) -> list[str]:
        return ['serve', 'proxy', '--server-name', HOST, '--server-port', str(port), '--serving-strategy',
                'DistServe', '--disable-cache-status', '--log-level', 'INFO', *self._keys()]

    def _node_args(self, port: int, role: str) -> list[str]:
        args = ['serve', 'api_server', str(self.config.model_dir.resolve()), '--backend', 'pytorch',
                '--server-name', HOST, '--server-port', str(port), '--model-name', MODEL_NAME, '--role', role,
                '--log-level', 'INFO', '--max-batch-size', str(self.config.max_batch_size), *self._keys(),
                *self.config.node_args]
        if role != 'Hybrid':  # a Hybrid node answers by itself: the reference a DistServe answer must equal
            args += ['--migration-backend', 'Mooncake', '--proxy-url', ','.join(self.proxy_urls)]
        if role == 'Decode':
            args += self.config.decode_args
        if self.config.max_prefill_token_num is not None:
            args += ['--max-prefill-token-num', str(self.config.max_prefill_token_num)]
        return args

    def _new_port(self) -> int:
        """A free port none of this cluster's processes was given: a port is free again until the node it went to
        has bound it (seen: a Prefill and a Decode both on one port, the Decode never registered)."""
        given = {int(proc.url.rsplit(':', 1)[1]) for proc in self.processes}
        while (port := free_port()) in given:
            pass
        return port

    def spawn_node(self, name: str, role: str) -> Process:
        """Start one more node; not waited for (``wait_http_ok`` on its ``/health``)."""
        return self._spawn(name, role, self._node_args)

    def _spawn(self, name: str, role: str, make_args, port: int | None = None) -> Process:
        restart = port is not None
        port = port if restart else self._new_port()
        args = make_args(port) if role == 'Proxy' else make_args(port, role)
        log = self.config.log_dir / f'{name}.log'
        state_file = None if role == 'Proxy' else str((self.config.log_dir / f'{name}.state.json').resolve())
        env = self._env(role, state_file)
        env[sim_settings.FAULTS] = str(self._faults_dir(name))
        with open(log, 'ab' if restart else 'wb') as out:  # a restart appends to the node's log
            # Own session = own process group, so stop() reaches the spawned engine child too.
            popen = subprocess.Popen([self.config.python, '-m', 'lmdeploy', *args], stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        proc = Process(name, role, f'http://{HOST}:{port}', popen.pid, str(log), state_file)
        self.processes.append(proc)
        return proc

    def _env(self, role: str, state_file: str | None) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            sim_settings.TOGGLE: '1',
            'LMDEPLOY_ENABLE_CHECK_ENV': '0',
            'LMDEPLOY_SKIP_WARMUP': '1',
            sim_settings.NUM_BLOCKS: str(self.config.num_blocks),
            'NO_PROXY': f'{HOST},localhost',
            'no_proxy': f'{HOST},localhost',
        })
        for var in (settings.TOGGLE, sim_settings.STATE, sim_settings.DROP_KV):
            env.pop(var, None)
        if not (self.config.stock or role in self.config.stock_roles):
            env[settings.TOGGLE] = '1'
        env.update(self.config.env)
        if self.config.api_key:
            env[settings.NODE_API_KEY.name] = self.config.api_key
        if state_file:
            env[sim_settings.STATE] = state_file
        if role == 'Decode' and self.config.drop_kv_on_decode:
            env[sim_settings.DROP_KV] = '1'
        return env

    def _register_late(self, deadline: float) -> None:
        """Restart each node whose registration reached the proxy before the proxy listened."""
        for proc in list(self.processes):
            if proc.role in ('Prefill', 'Decode') and _REGISTRATION_FAILED in Path(proc.log).read_bytes():
                self.stop_node(proc.url)
                self.restart_node(proc.url, timeout_s=max(deadline - time.monotonic(), 1.0))

    def _wait_registered(self, deadline: float) -> None:
        expected = {proc.url for proc in self.processes if proc.role in ('Prefill', 'Decode')}
        for proxy_url in self.proxy_urls:
            while not expected <= set(status := http_json('GET', f'{proxy_url}/nodes/status', timeout=5) or {}):
                if time.monotonic() > deadline:
                    raise TimeoutError(f'nodes not registered with the proxy {proxy_url}: '
                                       f'{sorted(expected - set(status))}')
                time.sleep(0.5)

    def process(self, url: str) -> Process:
        """The process serving ``url`` (proxy or node)."""
        for proc in self.processes:
            if proc.url == url:
                return proc
        raise KeyError(url)

    def stop_node(self, url: str) -> Process:
        """Stop one node's process group (api_server and engine) abruptly; the proxy keeps listing it."""
        proc = self.process(url)
        if proc.role == 'Proxy':
            raise ValueError('stop_node stops Prefill and Decode nodes only')
        stop_processes([proc], grace_s=0.0)
        proc.stopped = True
        return proc

    def freeze(self, url: str) -> Process:
        """Hang one node's process group (SIGSTOP): its kernel still accepts connections, it answers nothing, not
        even ``/health``, until :meth:`thaw`."""
        proc = self.process(url)
        if proc.role == 'Proxy':
            raise ValueError('freeze hangs Prefill and Decode nodes only')
        os.killpg(proc.pid, signal.SIGSTOP)
        proc.frozen = True
        return proc

    def thaw(self, url: str) -> Process:
        """Let a frozen node run on (SIGCONT)."""
        proc = self.process(url)
        os.killpg(proc.pid, signal.SIGCONT)
        proc.frozen = False
        return proc

    def restart_node(self, url: str, timeout_s: float | None = None) -> Process:
        """Start a stopped node again on the same URL; it re-registers with the proxy before it is healthy."""
        old = self.process(url)
        if not old.stopped:
            raise ValueError(f'{url} is running')
        port = int(url.rsplit(':', 1)[1])
        deadline = time.monotonic() + (self.config.startup_timeout_s if timeout_s is None else timeout_s)
        wait_port_free(port, deadline)
        self.processes.remove(old)
        proc = self._spawn(old.name, old.role, self._node_args, port=port)
        wait_http_ok(f'{proc.url}/health', deadline, proc.pid)
        self._wait_registered(deadline)
        return proc

    def revive(self) -> Cluster:
        """Every node up again: one a previous test stopped, or one that no longer answers ``/health``."""
        for proc in list(self.processes):
            if proc.role == 'Proxy':
                continue
            if proc.frozen:
                self.thaw(proc.url)
            if not proc.stopped and _healthy(proc.url):
                continue
            if not proc.stopped:
                self.stop_node(proc.url)
            self.restart_node(proc.url)
        return self

    def bounce(self, url: str, down_s: float = 1.0) -> Process:
        """Kill a node, leave it down ``down_s`` (requests meet it dead), start it again on the same URL."""
        self.stop_node(url)
        time.sleep(down_s)
        return self.restart_node(url)

    def _faults_dir(self, name: str) -> Path:
        return (self.config.log_dir / 'faults' / name).resolve()

    def arm_fault(self, url: str, fault: str, content: str = '') -> None:
        """Arm a one-shot fault (see :mod:`lmdeploy_pdfix_sim.faults`) in the node serving ``url``."""
        faults.arm(self._faults_dir(self.process(url).name), fault, content)

    def wait_fault_taken(self, url: str, fault: str, timeout_s: float = 10.0) -> None:
        """Return once the node has reached the faulty step (it took the armed fault)."""
        path = self._faults_dir(self.process(url).name) / fault
        deadline = time.monotonic() + timeout_s
        while path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f'{url} did not reach the armed fault {fault!r} within {timeout_s} s')
            time.sleep(0.02)

    def node_state(self, url: str) -> dict[str, Any]:
        return http_json('GET', f'{url}{STATE_ROUTE}', timeout=5, headers=self.credentials)

    def settled_state(self, url: str, timeout_s: float = 20.0, quiet_s: float = 1.0) -> dict[str, Any]:
        """The node's state once sessions and free blocks stopped changing for ``quiet_s`` (frees are async)."""
        deadline = time.monotonic() + timeout_s
        last, since = None, time.monotonic()
        while True:
            state = self.node_state(url)
            key = (state.get('sessions'), state.get('free_blocks'))
            if key != last:
                last, since = key, time.monotonic()
            elif time.monotonic() - since >= quiet_s or time.monotonic() > deadline:
                return state
            time.sleep(0.2)

    def stop(self) -> None:
        stop_processes(self.processes)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def to_json(self) -> dict[str, Any]:
        cfg = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(self.config).items()}
        return {'config': cfg, 'processes': [asdict(proc) for proc in self.processes], 'startup_s': self.startup_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cluster:
        cfg = dict(data['config'])
        cfg['log_dir'], cfg['model_dir'] = Path(cfg['log_dir']), Path(cfg['model_dir'])
        for name in ('stock_roles', 'node_args', 'decode_args'):
            cfg[name] = tuple(cfg.get(name, ()))
        return cls(ClusterConfig(**cfg), [Process(**proc) for proc in data['processes']], data.get('startup_s'))


def prefill_forwards(state: dict[str, Any]) -> int:
    """Forwards over prompt tokens (whole prompts and long-context chunks) in a node state."""
    counters = state.get('counters', {})
    return counters.get('forwards_prefill', 0) + counters.get('forwards_chunk', 0)


def free_port() -> int:
    """A loopback port in ``_NODE_PORTS`` that nothing holds now."""
    while True:
        port = random.choice(_NODE_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        return port


def http_json(method: str, url: str, body: Any = None, timeout: float = 10.0,
              headers: dict[str, str] | None = None) -> Any:
    """A small JSON request with the standard library (no proxies: everything is on loopback)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={'Content-Type': 'application/json', **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout) as response:
        return json.loads(response.read() or b'null')


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0): reap it if it is ours.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    return True


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
        http_json('GET', f'{url}/health', timeout=10)
        return True
    return False


def wait_http_ok(url: str, deadline: float, pid: int) -> None:
    while True:
        if not _alive(pid):
            raise RuntimeError(f'process {pid} exited before {url} answered')
        with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
            http_json('GET', url, timeout=2)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f'{url} not healthy in time')
        time.sleep(0.5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_port_free(port: int, deadline: float) -> None:
    """Until ``port`` on the loopback can be bound again (a killed server's socket may linger briefly)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((HOST, port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f'port {port} still in use') from None
        time.sleep(0.2)


def stop_processes(processes: list[Process], grace_s: float = _TERM_GRACE_S) -> None:
    """SIGTERM each started process group, SIGKILL what outlives the grace period (0: SIGKILL at once)."""
    groups = [proc.pid for proc in processes]  # start_new_session: pgid == pid of the started process
    if grace_s > 0:
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)
                os.killpg(pgid, signal.SIGCONT)  # a frozen group takes its SIGTERM only once it runs
    deadline = time.monotonic() + grace_s
    for pgid in groups:
        while time.monotonic() < deadline and (_alive(pgid) or _group_alive(pgid)):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pgid, os.WNOHANG)
