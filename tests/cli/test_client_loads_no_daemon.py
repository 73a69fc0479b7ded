"""The CLI is a client of the control plane: `marind submit/status/events/cancel/nodes/rm`
load no module of the daemon (``marind.agent``), against a real etcd.

The import check (``tools/import_graph.py --check``) forbids the edges in the source; this
test runs the commands in a fresh interpreter and reads ``sys.modules``, so a lazy import
added behind a string (``importlib``) fails it too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.agent.helpers import tiny_spec

SCRIPT = textwrap.dedent("""
    import json, sys
    from marind.cli import main
    spec, job = sys.argv[1], sys.argv[2]
    codes = {}
    for argv in (["submit", spec, "--id", job], ["status"], ["status", job], ["events", job, "--json"],
                 ["nodes"], ["cancel", job], ["rm", job, "--force"]):
        codes[" ".join(argv[:1])] = main(argv)
    loaded = sorted(m for m in sys.modules if m == "marind.agent" or m.startswith("marind.agent."))
    sys.stdout.write("RESULT " + json.dumps({"codes": codes, "agent_modules": loaded}) + "\\n")
""")


def test_cli_commands_load_no_agent_module(tmp_path, etcd, etcd_prefix, etcd_client):
    spec = tiny_spec(tmp_path)
    env = {"MARIND_ETCD": etcd.endpoint, "MARIND_PREFIX": etcd_prefix, "PATH": "/usr/bin:/bin",
           "MARIND_STATE_DIR": str(tmp_path / "state"), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(spec), "client-test-1"], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["codes"] == {"submit": 0, "status": 0, "events": 0, "nodes": 0, "cancel": 0, "rm": 0}, out.stderr
    assert result["agent_modules"] == [], "the CLI loaded the daemon's code: " + ", ".join(result["agent_modules"])
    # the commands really talked to etcd: the job was written, then removed
    assert etcd_client.get_prefix_json(etcd_client.key("jobs", "client-test-1") + "/") == {}
