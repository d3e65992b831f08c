"""The documentation (README.md, docs/) against its sources: benchmark tables generated from
their JSON, result files and repository paths that exist, test ids that name real tests."""

from __future__ import annotations

import json
import re
import sys

from _models import REPO

DOCS = REPO / "docs"
RESULTS = REPO / "benchmarks" / "results"
#: outputs of `make gpu-check` the pages name before any GPU run has produced them
GPU_OUTPUTS = {
    "gpu_copy_bench.json",
    *(f"{n}.json" for n in ("nixl_bench_cuda", "nixl_bench_cuda_tls", "region_bench_nixl")),
    "region_bench_nixl_tls.json",
    "region_bench_nixl_write.json",
}
#: repository paths as the pages write them (in backticks), optionally with ``::test``
PATH = re.compile(
    r"`((?:vllm_omni_kv|tests|benchmarks|examples|scripts)/[\w./-]+?)((?:::\w+)*)(?:\[\w+\])?`"
)
#: benchmark outputs (``transfer_bench.json``, ``pd_load.png``, ...)
RESULT_FILE = re.compile(r"\b([a-z0-9_]*(?:_bench|pd_load)[a-z0-9_]*\.(?:json|png))\b")


def _pages() -> dict[str, str]:
    pages = {p.name: p.read_text() for p in sorted(DOCS.glob("*.md"))}
    pages["README.md"] = (REPO / "README.md").read_text()
    return pages


def test_pd_load_table_is_the_output_of_pd_load_table() -> None:
    """docs/benchmarks.md holds exactly what ``pd_load.py --table`` prints from the JSON."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import pd_load
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    table = pd_load.table(json.loads((RESULTS / "pd_load.json").read_text()))
    assert table.count("\n|") >= 4, table
    assert table in (DOCS / "benchmarks.md").read_text()


def test_result_files_named_in_the_docs_exist() -> None:
    """Every ``*.json`` / ``*.png`` the pages name is in benchmarks/results/ (GPU outputs
    not produced yet excepted), and every benchmark section names its source."""
    named: dict[str, set[str]] = {}
    for page, text in _pages().items():
        for name in RESULT_FILE.findall(text):
            named.setdefault(name, set()).add(page)
    missing = {n: sorted(p) for n, p in named.items() if not (RESULTS / n).is_file()}
    assert set(missing) <= GPU_OUTPUTS, missing
    assert not any((RESULTS / n).exists() for n in GPU_OUTPUTS - set(named)), "update GPU_OUTPUTS"
    for heading in re.findall(r"^## (.+)$", (DOCS / "benchmarks.md").read_text(), re.M):
        if heading != "GPU":
            assert RESULT_FILE.search(heading), f"benchmark section without its JSON: {heading}"


def test_paths_and_test_ids_named_in_the_docs_exist() -> None:
    """Paths in backticks exist in the repository; ``file.py::name`` names a function or
    class of that file."""
    wrong = []
    for page, text in _pages().items():
        for path, ids in PATH.findall(text):
            target = REPO / path.rstrip("/")
            if "<" in path or not (target.exists() or target.with_suffix("").exists()):
                wrong.append(f"{page}: {path} does not exist")
                continue
            for name in filter(None, ids.split("::")):
                if not re.search(rf"^\s*(?:def|class) {name}\b", target.read_text(), re.M):
                    wrong.append(f"{page}: {path}::{name} is not defined there")
    assert not wrong, "\n".join(wrong)


def test_readme_links_into_docs_resolve() -> None:
    """The README's links into docs/ name existing pages (mkdocs checks the pages' own links)."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    assert all((REPO / link).is_file() for link in links), links
