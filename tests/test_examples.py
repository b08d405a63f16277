"""The example notebook runs top to bottom in a real Jupyter kernel (with quick overrides)."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AREAL_JAX_COMPILE_THREADS", raising=False)  # as a user runs it: the servers' default
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    quick = [f"run_dir={tmp_path}", "steps=2", "warm_start.steps=5", "data.size=200", "data.eval_size=8",
             "batch_size=2", "rollout.group_size=4"]
    params.source = f'CONFIG = "../configs/demo.yaml"\nOVERRIDES = {json.dumps(quick)}'
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "examples")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "held-out accuracy:" in text and "after 2 RL steps" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the curves plot rendered
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
