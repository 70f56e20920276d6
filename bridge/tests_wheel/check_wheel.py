"""The installed wheel, as a user gets it: run by the python of a fresh
venv that holds nothing but the wheel (scripts/wheel-tests.sh).

Checks that the package comes from the venv (not the checkout), that the
venv's bin/ holds the `orbitkv` command, and that a manager started from
there serves the installed package: a publish on one connection, a
restore of the same bytes on another, a clean stop. Prints
``wheel: N passed, 0 failed`` and exits 0, or names the failure and exits 1.
"""

from __future__ import annotations

import subprocess
import sys
import traceback
from pathlib import Path

VENV = Path(sys.prefix)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import orbitkv  # noqa: E402
import serve_support as s  # noqa: E402

BIN = VENV / "bin" / "orbitkv"


def installed_from_the_venv() -> None:
    where = Path(orbitkv.__file__).resolve()
    assert VENV.resolve() in where.parents, f"orbitkv imported from {where}, not {VENV}"
    assert BIN.is_file(), f"no {BIN}"
    out = subprocess.run([str(BIN), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("orbitkv "), out.stdout


def serves_the_installed_package() -> None:
    m = s.Manager(BIN).start()
    try:
        a = orbitkv.Client(m.socket, "wheel-publisher")
        s.publish(a, 4)
        b = orbitkv.Client(m.socket, "wheel-restorer")
        s.register(b)
        session = s.open_session(b)
        region = s.open_region(b, session)
        ready = s.query_ready(b, session, 4)
        assert s.check_pages(b, ready) == 4
        s.restore(b, session, region, ready, first_slot=8)
        s.check_region(b, region, ready, first_slot=8)
        a.close()
        b.close()
    finally:
        code = m.stop()
    assert code == 0, f"manager exit status {code}: {m.log_text()}"


def main() -> int:
    checks = [installed_from_the_venv, serves_the_installed_package]
    failed = 0
    for check in checks:
        try:
            check()
            print(f"ok {check.__name__}")
        except Exception:
            failed += 1
            print(f"FAILED {check.__name__}")
            traceback.print_exc()
    print(f"wheel: {len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
