"""The stored benchmark results and the pages that quote them: every path into benchmarks/results/
that BENCHMARKS.md, the README, docs/ and experiments/RESULTS.md cite exists, every file under
benchmarks/results/ is cited (itself or through a folder above it, so the folder holds only what
the pages quote), and every stored result names the card it ran on and, unless it predates the
harness recording it, the commit of the script that made it.

A page cites a result by its path (``benchmarks/results/<path>``, in a link, a code span or text),
by a link that resolves into the folder, or, as BENCHMARKS.md does once the folder is named, by a
bare code span: a result's own name, which carries its card (``wgmma_block_h100_c64/``,
``audit_speed_h100.md``), or a file name (``NOTE.md``), looked up in the folders its paragraph
cites. Naming ``benchmarks/results/`` itself cites nothing."""

from __future__ import annotations

import json
import pathlib
import re

import provenance
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = pathlib.PurePosixPath("benchmarks/results")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
EXPLICIT = re.compile(r"benchmarks/results/([\w./-]*)")
CODE_SPAN = re.compile(r"`([^`\s]+)`")
#: A result's name carries its card: ``train_step_h100/``, ``scaling_h200x4_lhs/``, ``audit_speed_cpu_2cores.md``.
CARD = re.compile(r"_(h100|h200|cpu)")
RESULT_FILE = re.compile(r"\.(md|json|jsonl|png|log)$")
#: A short (or full) git hash, "+changes" where the tree had uncommitted changes.
SCRIPT = re.compile(r"^[0-9a-f]{7,40}(\+changes)?$")

#: Results stored before the harness recorded the script's commit (``_common.host_summary``): what
#: made them is in the git history of benchmarks/, not in the file. A result made since records it.
WITHOUT_SCRIPT = {
    "adaptive_depth_h100.md",
    "audit_speed_cpu_2cores.md",
    "audit_speed_cpu_2cores_cached",
    "audit_speed_h100.md",
    "compile_time_h100_fused",
    "compile_time_h200_reference_autodiff",
    "compile_time_h200_wgmma",
    "dense_step_h100_fused",
    "dense_step_h200",
    "fused_block_h100",
    "hopper_checks_h100",
    "hopper_checks_h200",
    "memory_h100.md",
    "memory_h100_fused",
    "profile_step_h100",
    "train_step_h100",
    "train_step_h100_cudagraphs",
    "train_step_h100_fastest_torch_compile",
    "train_step_h100_models",
    "train_step_h100_plain",
    "train_step_h100_repeat",
    "wgmma_block_h100",
    "wgmma_block_h100_c64",
    "wgmma_block_h100_warpgroups",
}


def pages(repo: pathlib.Path = REPO) -> list[pathlib.Path]:
    return [
        repo / "BENCHMARKS.md",
        repo / "README.md",
        *sorted((repo / "docs").glob("*.md")),
        repo / "experiments" / "RESULTS.md",
    ]


def citations(page: pathlib.Path, repo: pathlib.Path = REPO) -> dict[str, str]:
    """The paths under benchmarks/results/ (relative to it, no trailing slash) that ``page`` cites,
    each with the words that cite it."""
    results = repo / RESULTS
    found: dict[str, str] = {}
    for paragraph in re.split(r"\n\s*\n", FENCE.sub("", page.read_text())):
        folders = []
        for m in EXPLICIT.finditer(paragraph):
            path = m.group(1).rstrip("./")
            if path:
                found.setdefault(path, m.group(0))
                folders.append(path)
        for target in LINK.findall(paragraph):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
                continue
            linked = (page.parent / target.partition("#")[0]).resolve()
            if results.resolve() in linked.parents:
                path = linked.relative_to(results.resolve()).as_posix()
                found.setdefault(path, target)
                folders.append(path)
        bare = [s for s in CODE_SPAN.findall(paragraph) if "/" not in s.rstrip("/") and not re.search(r"[<=]", s)]
        for span in bare:  # a result named by its own name first: the paragraph's files may be in it
            if CARD.search(span):
                found.setdefault(span.rstrip("/"), f"`{span}`")
                folders.append(span.rstrip("/"))
        for span in bare:
            if CARD.search(span) or not RESULT_FILE.search(span) or not folders:
                continue
            candidates = [f"{folder}/{span}" for folder in folders if not RESULT_FILE.search(folder)]
            if candidates:
                path = next((c for c in candidates if (results / c).exists()), candidates[0])
                found.setdefault(path, f"`{span}` beside {folders}")
    return found


def all_citations(repo: pathlib.Path = REPO) -> dict[str, tuple[str, str]]:
    """Every cited path: the page and the words of its first citation."""
    cited: dict[str, tuple[str, str]] = {}
    for page in pages(repo):
        if page.exists():
            for path, words in citations(page, repo).items():
                cited.setdefault(path, (str(page.relative_to(repo)), words))
    return cited


def stored_files(repo: pathlib.Path = REPO) -> list[str]:
    results = repo / RESULTS
    return sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file())


def missing(cited, repo: pathlib.Path = REPO) -> list[str]:
    return sorted(
        f"{path} ({page}: {words})" for path, (page, words) in cited.items() if not (repo / RESULTS / path).exists()
    )


def uncited(files: list[str], cited) -> list[str]:
    """The files that no cited path is, or lies above."""
    return [f for f in files if not any(f == c or f.startswith(c + "/") for c in cited)]


def test_the_pages_cite_the_stored_results():
    cited = all_citations()
    assert len(cited) >= 25, sorted(cited)
    assert "benchmarks/results" not in cited and "" not in cited


def test_every_cited_result_exists():
    assert not missing(all_citations()), f"cited under {RESULTS}/ but not stored: {missing(all_citations())}"


def test_every_stored_result_is_cited():
    left = uncited(stored_files(), all_citations())
    assert not left, (
        f"files under {RESULTS}/ that no page cites (cite them, or remove them: earlier results live in git history): "
        f"{left}"
    )


def test_the_checks_catch_a_missing_and_an_uncited_result(tmp_path):
    results = tmp_path / RESULTS
    for name in ("train_step_h100/train_step.md", "train_step_h100/variants/a.json", "notes_h200/NOTE.md"):
        (results / name).parent.mkdir(parents=True, exist_ok=True)
        (results / name).write_text("{}")
    (results / "memory_h100.md").write_text("")
    (results / "stray_h200.json").write_text("{}")
    (tmp_path / "docs").mkdir()
    (tmp_path / "BENCHMARKS.md").write_text(
        "Every figure is quoted from a file under `benchmarks/results/`.\n\n"
        "One card (`benchmarks/results/train_step_h100/`); the other, `notes_h200/` (`NOTE.md` says which).\n\n"
        "Before (`memory_h100.md`, `gone_h100/`); `naisnet_jax.kernels.wgmma_tf32`, `--size=cifar_2x3`.\n\n"
        "Its `dense_step.md` beside `benchmarks/results/train_step_h100/`.\n\n"
        "```\npython benchmarks/memory.py --out=benchmarks/results/in_code_h100\n```\n"
    )
    (tmp_path / "docs" / "performance.md").write_text("[the audit](../benchmarks/results/audit_h200/audit.md)")
    cited = all_citations(tmp_path)
    assert set(cited) == {
        "train_step_h100",
        "notes_h200",
        "notes_h200/NOTE.md",
        "memory_h100.md",
        "gone_h100",
        "train_step_h100/dense_step.md",
        "audit_h200/audit.md",
    }
    assert [m.split(" ")[0] for m in missing(cited, tmp_path)] == [
        "audit_h200/audit.md",
        "gone_h100",
        "train_step_h100/dense_step.md",
    ]
    assert uncited(stored_files(tmp_path), cited) == ["stray_h200.json"]


# ------------------------------------------------------------------------------ provenance


def records(repo: pathlib.Path = REPO) -> list[pathlib.Path]:
    """Every stored JSON result, less ``<name>_runs.json``, the runs of ``<name>.json`` beside it."""
    return [repo / RESULTS / f for f in stored_files(repo) if f.endswith(".json") and not f.endswith("_runs.json")]


def markdown_only(repo: pathlib.Path = REPO) -> list[pathlib.Path]:
    """Results stored as a markdown table alone (no JSON beside them)."""
    return [p for p in (repo / RESULTS).glob("*.md") if p.is_file()]


def result_name(path: pathlib.Path, repo: pathlib.Path = REPO) -> str:
    return path.relative_to(repo / RESULTS).parts[0]


def device_problems(record) -> list[str]:
    """A record names its card as ``device_kind`` (``_common.device_summary``) or as ``device``
    ("NVIDIA H200 (gpu)", ``audit_speed.py``)."""
    names = [v for v in provenance.fields(record, ("device_kind", "device")) if isinstance(v, str) and v.strip()]
    return [] if names else ["no 'device_kind' or 'device' naming the card"]


def script_problems(record) -> list[str]:
    scripts = provenance.fields(record, ("script",))
    if not scripts:
        return ["no 'script' field: the commit that made it is not recorded"]
    bad = sorted({str(s) for s in scripts if not (isinstance(s, str) and SCRIPT.match(s))})
    return [f"'script' values that name no commit: {bad}"] if bad else []


def test_the_provenance_checks_catch_what_they_are_for():
    made_now = {"rows": [{"device_kind": "NVIDIA H200", "platform": "gpu", "script": "4d2326f+changes"}]}
    assert device_problems(made_now) == [] and script_problems(made_now) == []
    assert device_problems({"device": "cpu (cpu)"}) == []
    assert device_problems({"rows": [{"platform": "gpu"}]}) and device_problems({"device_kind": ""})
    assert script_problems({"device": {"device_kind": "NVIDIA H200"}})
    assert script_problems({"script": "unknown"})


def test_the_runs_files_have_their_result_beside_them():
    for path in (REPO / RESULTS).rglob("*_runs.json"):
        assert path.with_name(path.name.replace("_runs.json", ".json")).exists(), path


@pytest.mark.parametrize("path", records(), ids=lambda p: str(p.relative_to(REPO / RESULTS)))
def test_every_stored_result_names_its_card_and_script(path):
    record = json.loads(path.read_text())
    assert not device_problems(record), f"{path.relative_to(REPO)}: {device_problems(record)}"
    if result_name(path) not in WITHOUT_SCRIPT:
        assert not script_problems(record), f"{path.relative_to(REPO)}: {script_problems(record)}"


@pytest.mark.parametrize("path", markdown_only(), ids=lambda p: p.name)
def test_every_markdown_result_names_its_card(path):
    assert re.search(r"\bdevice:? (NVIDIA|cpu)\b", path.read_text()), f"{path.relative_to(REPO)} names no device"


def test_the_results_without_a_script_are_those_listed():
    """Each listed result is stored and still lacks the commit somewhere (rerun, it leaves the list)."""
    stored = {result_name(p) for p in [*records(), *markdown_only()]}
    assert WITHOUT_SCRIPT <= stored, sorted(WITHOUT_SCRIPT - stored)
    lacking = {result_name(p) for p in records() if script_problems(json.loads(p.read_text()))}
    lacking |= {p.name for p in markdown_only()}  # a markdown table records no commit
    assert lacking == WITHOUT_SCRIPT, f"lacking a script: {sorted(lacking)}; listed: {sorted(WITHOUT_SCRIPT)}"


def test_every_recorded_script_is_in_the_history():
    if not provenance.full_history():
        pytest.skip("not a full git checkout: the recorded commits cannot be looked up")
    scripts = [s for p in records() for s in provenance.fields(json.loads(p.read_text()), ("script",))]
    assert scripts, "no stored result records its script"
    unknown = provenance.unknown_commits(scripts)
    assert not unknown, f"recorded script commits that this repository does not hold: {unknown}"
