"""``lmdeploy-pdfix``: ``status`` of the patches and ``doctor`` of a running cluster. (The GPU-free cluster and
its load loop are ``lmdeploy-pdfix-sim``, of the test-only ``lmdeploy-pdfix-sim`` distribution.)"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from lmdeploy_pdfix import settings
from lmdeploy_pdfix.registry import PATCHES, PatchSpec

NOT_APPLICABLE = 'not applicable'


def _patch_status(spec: PatchSpec, disabled: frozenset[str]) -> dict[str, Any]:
    """What the patch does in this interpreter: applied, disabled by the user, or refused and why."""
    from lmdeploy_pdfix._bootstrap import load_patch, requirement_problem
    from lmdeploy_pdfix.patching import PatchState

    row: dict[str, Any] = {'name': spec.name, 'target': spec.target, 'summary': spec.summary}
    if spec.name in disabled:
        return {**row, 'state': 'disabled', 'reason': f'listed in {settings.DISABLE}'}
    try:
        module = importlib.import_module(spec.target)
        patch = load_patch(spec)
    except ModuleNotFoundError as exc:  # an optional dependency of LMDeploy (e.g. Ray): nothing there to fix
        return {**row, 'state': NOT_APPLICABLE, 'reason': f'{exc.name} is not installed, so LMDeploy does not use '
                                                          f'{spec.target} here; nothing to fix'}
    except Exception as exc:
        return {**row, 'state': 'refused', 'reason': f'cannot import: {exc!r}'}
    if patch.state is PatchState.APPLIED:
        return {**row, 'state': 'applied', 'reason': None}
    reason = patch.reason or settings.problem_for(spec.name) or requirement_problem(spec) or patch.refusal(module)
    if reason and reason.startswith(f'{NOT_APPLICABLE}: '):
        return {**row, 'state': NOT_APPLICABLE, 'reason': reason.removeprefix(f'{NOT_APPLICABLE}: ')}
    return {**row, 'state': 'refused' if reason else 'ready', 'reason': reason}


def status_report() -> dict[str, Any]:
    from lmdeploy_pdfix.compat import LMDEPLOY_REQUIREMENT, lmdeploy_version

    disabled = settings.disabled_patches()
    known = {spec.name for spec in PATCHES}
    return {
        'lmdeploy_version': lmdeploy_version(),
        'supported': LMDEPLOY_REQUIREMENT,
        'enabled': settings.enabled(),
        'unknown_disabled_names': sorted(disabled - known),
        'patches': [_patch_status(spec, disabled) for spec in PATCHES],
        'node_key': _node_key_status(),
    }


MAX_TIMEOUT_S = 3600.0


def _node_key_status() -> dict[str, Any]:
    if settings.NODE_API_KEY.value() is not None:
        return {'set': True, 'leaves_open': []}
    return {'set': False, 'leaves_open': [  # docs/security.md
        "anyone who reaches a node's port can link it, migrate a cache whose owner and blocks they know, claim "
        'and free caches, and read its audit (run nodes with --api-keys and set the key here)',
        'Decode nodes confirm every cache by a claim before migrating it (no cache tickets)']}


def _print_status(report: dict[str, Any]) -> None:
    toggle = 'on' if report['enabled'] else f'off (set {settings.TOGGLE}=1 to enable)'
    print(f"LMDeploy {report['lmdeploy_version'] or 'not installed'} (supported: {report['supported']})")
    print(f'{settings.TOGGLE}: {toggle}')
    name_width = max(len(row['name']) for row in report['patches'])
    state_width = max(len(row['state']) for row in report['patches'])
    for row in report['patches']:
        reason = f" - {row['reason']}" if row['reason'] else ''
        print(f"  {row['name']:<{name_width}} {row['state']:<{state_width}}{reason}")
    if report['unknown_disabled_names']:
        print(f"  unknown names in {settings.DISABLE}: {', '.join(report['unknown_disabled_names'])}")
    node_key = report['node_key']
    print(f"{settings.NODE_API_KEY.name}: {'set' if node_key['set'] else 'unset, which leaves open:'}")
    for what in node_key['leaves_open']:
        print(f'  - {what}')


@contextlib.contextmanager
def _stdout_on_stderr() -> Iterator[None]:
    """Whatever importing LMDeploy writes to stdout (its logger does) goes to stderr meanwhile, at the file
    descriptor: its handlers hold the stdout stream itself, so swapping ``sys.stdout`` would not do."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def status(as_json: bool) -> int:
    with _stdout_on_stderr() if as_json else contextlib.nullcontext():  # stdout carries the JSON alone
        report = status_report()
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print_status(report)
    refused = [row for row in report['patches'] if row['state'] == 'refused']
    return 1 if refused else 0


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_TIMEOUT_S:  # nan and inf too
        raise argparse.ArgumentTypeError(f'{text} is not a number of seconds in (0, {MAX_TIMEOUT_S:g}]')
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog='lmdeploy-pdfix', description=__doc__)
    commands = parser.add_subparsers(dest='command', required=True)
    status_parser = commands.add_parser('status', help='LMDeploy version, toggle and the state of every patch')
    status_parser.add_argument('--json', action='store_true', help='machine-readable output')
    doctor_parser = commands.add_parser('doctor', help='ask a DistServe proxy and each of its nodes; list problems',
                                        epilog='exit status: 0 healthy, 1 problems found, 3 the proxy could not be '
                                               'asked (2: a wrong command line)')
    doctor_parser.add_argument('--proxy', required=True, help='the proxy URL, e.g. http://127.0.0.1:8000, or its '
                                                              "replicas' URLs, comma-separated")
    doctor_parser.add_argument('--json', action='store_true', help='machine-readable output')
    doctor_parser.add_argument('--timeout', type=_seconds, default=5.0, help='seconds to wait for each answer')
    args = parser.parse_args(argv)
    if args.command == 'doctor':
        from lmdeploy_pdfix.tools.doctor import doctor

        return doctor(args.proxy, args.json, args.timeout)
    return status(args.json)


if __name__ == '__main__':
    sys.exit(main())
