"""The start-up hook: off means absent, on means every patch applies whatever the import order.

Each case runs in a fresh interpreter of this environment, where the package is installed with its
``lmdeploy_pdfix.pth`` start-up hook, started outside the repository so the installed copy is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from lmdeploy_pdfix.registry import PATCHES
from lmdeploy_pdfix_sim.misshape import misshapen_target
from tests.forked import WarmInterpreter

TARGET = 'lmdeploy.pytorch.disagg.conn.proxy_conn'

# Prints, as JSON: is the proxy shelf wrapped by us, and which of our modules are loaded.
REPORT = textwrap.dedent(f"""
    import json, sys
    import {TARGET} as target
    loaded = any(name.startswith('lmdeploy_pdfix') for name in sys.modules)
    from lmdeploy_pdfix.patching import wrapped_original
    unshelf = target.PDConnectionPool.unshelf_prefill_session
    print(json.dumps({{
        'wrapped': wrapped_original(unshelf) is not None,
        'double_wrapped': wrapped_original(wrapped_original(unshelf)) is not None,
        'pdfix_loaded': loaded,
    }}))
""")


def stock_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith('LMDEPLOY_PDFIX')}
    env.pop('PYTHONPATH', None)
    return env


def run_python(code: str, tmp_path: Path, *, toggle: str | None = None, args: tuple[str, ...] = (),
               extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = stock_env()
    if toggle is not None:
        env['LMDEPLOY_PDFIX'] = toggle
    env.update(extra_env or {})
    result = subprocess.run([sys.executable, *args, '-c', code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


def logged(result: subprocess.CompletedProcess) -> list[str]:
    """Log lines, wherever they went (LMDeploy's logger writes to stdout)."""
    return (result.stdout + result.stderr).splitlines()


def last_json(result: subprocess.CompletedProcess) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('toggle', [None, '', '0'], ids=['unset', 'empty', 'zero'])
def test_toggle_off_leaves_lmdeploy_stock_and_loads_nothing_of_ours(tmp_path: Path, toggle: str | None) -> None:
    report = last_json(run_python(REPORT, tmp_path, toggle=toggle))
    assert report == {'wrapped': False, 'double_wrapped': False, 'pdfix_loaded': False}


def test_toggle_on_patches_lmdeploy_imported_after_start_up(tmp_path: Path) -> None:
    report = last_json(run_python(REPORT, tmp_path, toggle='1'))
    assert report['wrapped'] and not report['double_wrapped']


def test_start_up_hook_imports_no_lmdeploy_module(tmp_path: Path) -> None:
    code = "import sys, json; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'lmdeploy')))"
    for toggle in (None, '1'):
        assert json.loads(run_python(code, tmp_path, toggle=toggle).stdout) == []


def test_install_after_lmdeploy_was_imported_patches_it_once(tmp_path: Path) -> None:
    code = f'import {TARGET}\nimport lmdeploy_pdfix\nlmdeploy_pdfix.install()\nlmdeploy_pdfix.install()\n' + REPORT
    report = last_json(run_python(code, tmp_path))
    assert report['wrapped'] and not report['double_wrapped']


def test_install_twice_with_the_hook_on_wraps_once(tmp_path: Path) -> None:
    code = 'import lmdeploy_pdfix\nlmdeploy_pdfix.install()\n' + REPORT
    report = last_json(run_python(code, tmp_path, toggle='1'))
    assert report['wrapped'] and not report['double_wrapped']


def test_python_dash_S_with_explicit_install(tmp_path: Path) -> None:
    import site

    paths = [path for path in sys.path if path and Path(path).is_dir()] + site.getsitepackages()
    code = f'import sys\nsys.path[:0] = {paths!r}\nimport lmdeploy_pdfix\nlmdeploy_pdfix.install()\n' + REPORT
    report = last_json(run_python(code, tmp_path, toggle='1', args=('-S',)))
    assert report['wrapped']


def test_a_patch_the_operator_opted_out_of_stays_stock(tmp_path: Path) -> None:
    code = REPORT + textwrap.dedent("""
        import lmdeploy.pytorch.engine.inputs_maker as maker
        print(json.dumps({'others': wrapped_original(maker.InputsMakerAsync.update_running_seqs) is not None}))
    """)
    result = run_python(code, tmp_path, toggle='1', extra_env={'LMDEPLOY_PDFIX_DISABLE': 'proxy_connections'})
    first, second = (json.loads(line) for line in result.stdout.strip().splitlines()[-2:])
    assert not first['wrapped'] and second['others']


def test_unsupported_lmdeploy_version_is_refused_once_and_lmdeploy_still_works(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import lmdeploy.version
        lmdeploy.version.__version__ = '0.16.0'
        import {TARGET} as target
        pool = target.PDConnectionPool()
        pool.shelf_prefill_session(('p', 'd'), 1)
        pool.unshelf_prefill_session(('p', 'd'), 1)
        from lmdeploy_pdfix.patching import wrapped_original
        print(wrapped_original(target.PDConnectionPool.unshelf_prefill_session) is not None)
    """)
    result = run_python(code, tmp_path, toggle='1')
    assert result.stdout.strip().splitlines()[-1] == 'False'
    refusals = [line for line in logged(result) if "patch 'proxy_connections' not applied" in line]
    assert len(refusals) == 1 and 'outside the supported range' in refusals[0]


def test_target_of_unexpected_shape_is_refused_with_the_reason(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import {TARGET} as target
        def unshelf_prefill_session(self, key, session_id, extra): pass
        target.PDConnectionPool.unshelf_prefill_session = unshelf_prefill_session
        import lmdeploy_pdfix
        lmdeploy_pdfix.install()
        print(target.PDConnectionPool.unshelf_prefill_session is unshelf_prefill_session)
    """)
    result = run_python(code, tmp_path)
    assert result.stdout.strip().splitlines()[-1] == 'True'
    refusal, = (line for line in logged(result) if "patch 'proxy_connections' not applied" in line)
    assert "takes ['self', 'key', 'session_id', 'extra']" in refusal


def test_status_command_reports_every_patch_applied(tmp_path: Path) -> None:
    code = 'from lmdeploy_pdfix.tools.cli import main\nraise SystemExit(main(["status", "--json"]))'
    result = run_python(code, tmp_path, toggle='1')
    report = json.loads(result.stdout[result.stdout.index('{'):])
    assert report['enabled'] is True
    assert {row['name']: row['state'] for row in report['patches']} == {spec.name: 'applied' for spec in PATCHES}


def installed_distribution() -> metadata.Distribution:
    """This package as installed in the environment (not a build's metadata left in the checkout)."""
    import site

    found = list(metadata.distributions(name='lmdeploy-pdfix', path=site.getsitepackages()))
    assert found, 'lmdeploy-pdfix is not installed in this environment (make env installs it)'
    return found[0]


def test_wheel_installs_the_start_up_hook_at_the_environment_root() -> None:
    files = installed_distribution().files or []
    assert 'lmdeploy_pdfix.pth' in {str(path) for path in files}


# --- declared requirements: a patch whose requirement is off stays stock with it ---------------------------------

ENGINE = 'lmdeploy.pytorch.engine.engine'
ENGINE_CONN = 'lmdeploy.pytorch.disagg.conn.engine_conn'
# engine.py imports engine_conn, which finishes first: its patch then waits for the engine's to settle.
# The loop module imports both the other way round. (engine_conn alone cannot be imported first: LMDeploy's
# own circular import.)
ORDERS = {'engine': (ENGINE,), 'engine-loop': ('lmdeploy.pytorch.engine.engine_loop', ENGINE_CONN, ENGINE)}
STATES = textwrap.dedent("""
    import json
    from lmdeploy_pdfix._bootstrap import load_patch
    from lmdeploy_pdfix.registry import BY_NAME
    print(json.dumps({name: [load_patch(BY_NAME[name]).state.value, load_patch(BY_NAME[name]).reason]
                      for name in ('engine_sessions', 'engine_connections')}))
""")


@pytest.mark.parametrize('order', ORDERS.values(), ids=ORDERS)
def test_a_patch_whose_requirement_is_disabled_stays_stock(tmp_path: Path, order: tuple[str, ...]) -> None:
    # engine_connections alone answers every free with 'refused': the Prefill would keep every session (issue 10)
    code = ''.join(f'import {name}\n' for name in order) + STATES
    result = run_python(code, tmp_path, toggle='1', extra_env={'LMDEPLOY_PDFIX_DISABLE': 'engine_sessions'})
    states = last_json(result)
    assert states['engine_connections'][0] == 'refused'
    assert 'requires engine_sessions' in states['engine_connections'][1]


@pytest.mark.parametrize('order', ORDERS.values(), ids=ORDERS)
def test_a_patch_waits_for_its_requirement_whatever_the_import_order(tmp_path: Path, order: tuple[str, ...]) -> None:
    code = ''.join(f'import {name}\n' for name in order) + STATES
    assert last_json(run_python(code, tmp_path, toggle='1')) == {'engine_sessions': ['applied', None],
                                                                  'engine_connections': ['applied', None]}


def test_a_patch_whose_requirement_is_refused_is_refused_with_the_reason(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        from lmdeploy_pdfix.units import engine_sessions as engine
        engine.PATCH.shape_problem = lambda module: 'a renamed attribute'
        import {ENGINE}
    """) + STATES
    states = last_json(run_python(code, tmp_path, toggle='1'))
    assert states['engine_sessions'] == ['refused', 'a renamed attribute']
    assert states['engine_connections'] == ['refused',
                                            'requires engine_sessions, which is refused: a renamed attribute']


def test_a_bad_switch_value_leaves_the_patches_it_tunes_stock_with_one_clear_reason(tmp_path: Path) -> None:
    # a typo used to reach the engine loop: float('10m') raised at the first END_SESSION and ended the loop
    code = f'import {ENGINE}\n' + STATES
    result = run_python(code, tmp_path, toggle='1', extra_env={'LMDEPLOY_PDFIX_ORPHAN_TTL_S': '10m'})
    states = last_json(result)
    assert states['engine_sessions'] == ['refused', "LMDEPLOY_PDFIX_ORPHAN_TTL_S='10m' is not a number of seconds; "
                                                    'fix or unset it']
    assert states['engine_connections'][0] == 'refused'
    assert sum("patch 'engine_sessions' not applied" in line for line in logged(result)) == 1


def test_an_unknown_name_in_the_disable_list_is_reported(tmp_path: Path) -> None:
    result = run_python(f'import {TARGET}', tmp_path, toggle='1',
                        extra_env={'LMDEPLOY_PDFIX_DISABLE': 'engine_session'})
    assert any('names no patch called engine_session' in line for line in logged(result))


@pytest.fixture(scope='module')
def warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmInterpreter]:
    interpreter = WarmInterpreter(stock_env(), tmp_path_factory.mktemp('warm'))
    yield interpreter
    interpreter.close()


@pytest.mark.parametrize('unit', sorted(spec.name for spec in PATCHES))
def test_a_unit_refused_alone_leaves_its_target_stock_and_every_other_unit_applied(
        tmp_path: Path, warm: WarmInterpreter, unit: str) -> None:
    module_name, path = misshapen_target(unit).split(':')
    attribute, *parents = reversed(path.split('.'))
    code = textwrap.dedent(f"""
        import importlib, json
        import lmdeploy.pytorch.engine.engine  # LMDeploy's own import order: engine_conn alone is circular
        from lmdeploy_pdfix_sim.misshape import is_untouched, misshape
        module = importlib.import_module({module_name!r})
        misshapen = misshape(module, {path!r})
        import lmdeploy_pdfix
        lmdeploy_pdfix.install()
        from lmdeploy_pdfix.tools.cli import status_report
        rows = status_report()['patches']
        print(json.dumps({{'states': {{row['name']: row['state'] for row in rows}},
                           'reasons': {{row['name']: row['reason'] for row in rows}},
                           'untouched': is_untouched(module, {path!r}, misshapen)}}))
    """)
    result = warm.run(code, tmp_path)  # a fresh LMDeploy, the hook not run: install() does it
    assert result.returncode == 0, result.stdout
    report = last_json(result)
    dependants = {spec.name for spec in PATCHES if unit in spec.requires}
    refused = {name for name, state in report['states'].items() if state != 'applied'}
    assert unit in refused and report['untouched'], f'{unit} wrapped what its guard refused'
    assert all(report['reasons'][name].startswith(f'requires {unit}') for name in dependants)
    # besides its dependants, only units whose own guard reads the same LMDeploy object may refuse with it
    named = (attribute, *parents[:1])
    assert {name for name in refused - {unit} - dependants
            if not any(word in report['reasons'][name] for word in named)} == set(), report['reasons']
    assert {report['states'][name] for name in refused} == {'refused'}
    # every refusal reaches the operator's log, not only the first (LMDeploy's logger drops repeated warnings)
    assert {name for name in refused if not any(f'patch {name!r} not applied' in line for line in logged(result))
            } == set()
