"""The README's first command, end to end at a short duration: set-up, then the demo (a real
`codraft serve` of SmolLM2-135M, `codraft learn` beside it, the held-out comparison), and
what it leaves: report.json with its figures and demo.png."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_run_command() -> str:
    """The first command of README.md's "Two commands" (the demo)."""
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    demo = [b.strip() for b in blocks if "scripts/demo.py" in b]
    assert demo, "README.md has no bash block that runs scripts/demo.py"
    return demo[0]


@pytest.mark.vllm
def test_the_readme_demo_runs_end_to_end_and_writes_its_report(tmp_path: Path) -> None:
    command = readme_run_command()
    assert "--minutes" in command, command
    out = tmp_path / "demo"
    short = re.sub(r"--minutes \S+", "--minutes 1", command) + f" --out {out}"
    done = subprocess.run(
        ["bash", "-c", short], cwd=ROOT, capture_output=True, text=True, timeout=1500
    )
    tail = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, tail
    assert "Traceback" not in done.stderr, tail
    report = json.loads((out / "report.json").read_text())
    assert "error" not in report, report.get("error")
    assert report["requests"] > 0 and report["failed_requests"] == 0, report
    served = report["final_draft_version"]
    assert isinstance(served, int) and Path(report["final_draft_path"]).is_dir(), report
    assert str(out / "server") in report["final_draft_path"], "not the server's own copy"
    assert report["rollbacks"] == len(report["rollback_events"]) >= report["auto_rollbacks"]
    assert report["baseline_tokens_per_s"] > 0 and report["spec_tokens_per_s"] > 0, report
    assert report["speedup"] == pytest.approx(
        report["spec_tokens_per_s"] / report["baseline_tokens_per_s"]
    )
    assert report["heldout_acceptance_length"] >= 1.0
    # float32 on the CPU: speculation is lossless, greedy outputs are the target's own
    assert report["identical_outputs"] == report["heldout_prompts"] > 0, report
    assert report["samples"], "the live view recorded nothing"

    import matplotlib.image

    png = out / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape[:2] == (720, 960)  # 8 x 6 inches at 120 dpi
