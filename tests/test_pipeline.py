"""Specs, loaders, post-processing, metrics and artifacts, against hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path

import jiwer
import pytest
import sacrebleu

from fedpool.pipeline import (
    ArtifactError,
    ArtifactWriter,
    DataError,
    ErrorKind,
    Provenance,
    SpecError,
    aggregate,
    apply_postprocess,
    finish_record,
    load_samples,
    load_spec,
    read_records,
    redact,
    request_body,
    split_reasoning,
    summarize_records,
)
from fedpool.pipeline.bundled import bundled_spec_paths
from fedpool.pipeline.loaders import dataset_sha256
from fedpool.pipeline.metrics import aggregate_corpus, anls, bleu, exact_match, token_f1, wer

SPEC_YAML = """\
name: tiny
data: {path: data.jsonl}
prompt: {template: "Q: {question}\\nA:"}
generation: {max_tokens: 4, stop: ["\\n"]}
postprocess: [first_line, strip_punct]
metrics: [exact_match]
"""


def write_spec(tmp_path: Path, text: str = SPEC_YAML, rows: list[str] | None = None) -> Path:
    (tmp_path / "spec.yaml").write_text(text)
    default = [json.dumps({"id": i, "question": f"q{i}", "answer": f"a{i}"}) for i in range(3)]
    lines = rows if rows is not None else default
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "spec.yaml"


# ---- specs ------------------------------------------------------------------------------------
def test_bundled_benchmarks_load_with_50_plus_samples() -> None:
    for path in bundled_spec_paths():
        spec = load_spec(path)
        samples = load_samples(spec)
        assert len(samples) >= 50, spec.name
        assert len({s.sample_id for s in samples}) == len(samples)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("name: x\n  bad: [", "spec.yaml:"),
        ("- a list\n", "must be a mapping"),
        (SPEC_YAML.replace("[exact_match]", "[bleurt]"), "field 'metrics': Value error, unknown metric"),
        (SPEC_YAML.replace("[first_line, strip_punct]", "[magic]"), "unknown post-processor 'magic'"),
        (SPEC_YAML.replace("max_tokens: 4", "max_tokens: -1"), "field 'generation.max_tokens'"),
        (SPEC_YAML.replace("name: tiny", "name: tiny\nsurprise: 1"), "field 'surprise'"),
        (SPEC_YAML.replace("{question}", "{answer}"), "shows the label field"),
        (SPEC_YAML.replace("{question}", "{question!r:>{w}}"), "template"),
    ],
)
def test_bad_specs_name_file_and_field(tmp_path: Path, text: str, fragment: str) -> None:
    path = write_spec(tmp_path, text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(path) in str(err.value) and fragment in str(err.value)


# ---- loaders ----------------------------------------------------------------------------------
def test_bad_rows_reported_with_file_and_line(tmp_path: Path) -> None:
    rows = [
        json.dumps({"id": 1, "question": "q", "answer": "a"}),
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"id": 2, "answer": "a"}),
        json.dumps({"id": 1, "question": "q", "answer": "a"}),
        json.dumps({"id": 3, "question": "q", "answer": True}),
        json.dumps({"id": 4, "question": {"nested": 1}, "answer": "a"}),
    ]
    path = write_spec(tmp_path, rows=rows)
    with pytest.raises(DataError) as err:
        load_samples(load_spec(path))
    text = str(err.value)
    data = tmp_path / "data.jsonl"
    for line, fragment in [(2, "malformed JSON"), (3, "not an object"), (4, "missing field 'question'"),
                           (5, "duplicate id '1'"), (6, "label field"), (7, "must be text")]:
        assert f"{data}:{line}: " in text and fragment in text, (line, fragment)


def test_empty_dataset_and_csv(tmp_path: Path) -> None:
    path = write_spec(tmp_path, rows=[])
    with pytest.raises(DataError, match="no samples"):
        load_samples(load_spec(path))
    (tmp_path / "d.csv").write_text("id,question,answer\n1,what,yes\n2,why,no\n")
    spec = load_spec(write_spec(tmp_path, SPEC_YAML.replace("data.jsonl", "d.csv")))
    assert [s.labels for s in load_samples(spec)] == [("yes",), ("no",)]


def test_parquet_loader_and_its_bad_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": [1, 2, 3, 4], "question": ["q1", "q2", None, "q4"],
                      "answer": [["a", "b"], ["c"], ["d"], ["e"]]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)  # two row groups
    spec = load_spec(write_spec(tmp_path, SPEC_YAML.replace("data.jsonl", "d.parquet")))
    with pytest.raises(DataError) as err:
        load_samples(spec)
    assert f"{tmp_path / 'd.parquet'} row 3: " in str(err.value) and "is null" in str(err.value)
    pq.write_table(table.filter(pa.array([True, True, False, True])), tmp_path / "d.parquet")
    samples = load_samples(spec)
    assert [(s.sample_id, s.labels) for s in samples] == [("1", ("a", "b")), ("2", ("c",)), ("4", ("e",))]
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_samples(load_spec(write_spec(tmp_path, SPEC_YAML.replace("data.jsonl", "bad.parquet"))))


def test_hf_dataset_saved_to_disk(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")  # an optional loader; installed with the dev extras
    rows = {"id": ["x", "y"], "question": ["q1", "q2"], "answer": ["a1", "a2"]}
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows), "dev": datasets.Dataset.from_dict(rows)}
                         ).save_to_disk(str(tmp_path / "ds"))
    spec = load_spec(write_spec(tmp_path, SPEC_YAML.replace("{path: data.jsonl}", "{path: ds, split: test}")))
    assert [s.sample_id for s in load_samples(spec)] == ["x", "y"]
    assert len(dataset_sha256(tmp_path / "ds")) == 64
    unsplit = load_spec(write_spec(tmp_path, SPEC_YAML.replace("{path: data.jsonl}", "{path: ds}")))
    with pytest.raises(DataError, match=r"data\.split is required"):
        load_samples(unsplit)
    wrong = load_spec(write_spec(tmp_path, SPEC_YAML.replace("{path: data.jsonl}", "{path: ds, split: train}")))
    with pytest.raises(DataError, match="no split 'train'"):
        load_samples(wrong)


# ---- post-processing and metrics --------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "letter"),
    [("The answer is (B)", "B"), ("B. Paris", "B"), ("b", "B"), (" (c) because", "C"), ("Answer: D", "D"),
     ("I think it is", ""), ("", "")],
)
def test_multiple_choice_extraction(raw: str, letter: str) -> None:
    assert apply_postprocess(raw, ["multiple_choice"]) == letter


@pytest.mark.parametrize(("raw", "num"), [(" 37", "37"), ("= 1,200.0 apples", "1200"), ("-3.5", "-3.5"), ("none", "")])
def test_number_extraction(raw: str, num: str) -> None:
    assert apply_postprocess(raw, ["number"]) == num


def test_reasoning_moves_out_of_the_answer() -> None:
    assert split_reasoning("<think>2+2 is 4</think> 4") == ("4", "2+2 is 4")
    assert split_reasoning("plain") == ("plain", None)


def test_metric_values_by_hand() -> None:
    assert exact_match(" Paris.", ["paris"]) == 1.0
    assert exact_match("Lyon", ["Paris"]) == 0.0
    assert token_f1("the cat sat", ["cat sat down"]) == pytest.approx(2 * (2 / 3) * (2 / 3) / (4 / 3))
    assert wer("a b c", ["a x c d"]) == pytest.approx(0.5)
    score = aggregate("exact_match", [1, 0, 1, 1])
    assert score.value == 75.0 and score.ci_low <= 75.0 <= score.ci_high and score.n == 4


def test_corpus_wer_cer_and_bleu_match_their_libraries() -> None:
    preds = ["a b c", "hello world", ""]
    refs = ["a x c d", "hello there world", "one two"]
    pairs = [(p, [r]) for p, r in zip(preds, refs, strict=True)]
    # Corpus WER: (2 + 1 + 2) edits over (4 + 3 + 2) reference words, not the mean of per-sample rates.
    score = aggregate_corpus("wer", pairs)
    assert score.value == pytest.approx(100 * 5 / 9)
    assert score.ci_low <= score.value <= score.ci_high and score.n == 3
    assert aggregate_corpus("cer", pairs).value == pytest.approx(
        100 * jiwer.cer(refs, [p or " " for p in preds]), rel=0.02)  # jiwer's corpus CER (" " for the empty one)
    mt_preds = ["the cat sat on the mat", "a quick brown fox jumps", "it rains today"]
    mt_refs = [["the cat sat on a mat"], ["the quick brown fox jumped"], ["it is raining today"]]
    corpus = sacrebleu.corpus_bleu(mt_preds, [[r[0] for r in mt_refs]]).score
    assert aggregate_corpus("bleu", list(zip(mt_preds, mt_refs, strict=True))).value == pytest.approx(corpus)
    assert bleu("the cat sat on the mat", ["the cat sat on the mat"]) == pytest.approx(1.0)


def test_anls_by_hand() -> None:
    assert anls("Paris", ["paris"]) == 1.0
    assert anls("Pariss", ["Paris"]) == pytest.approx(1 - 1 / 6)  # one edit over the longer length
    assert anls("London", ["Paris"]) == 0.0  # NL ≥ 0.5 scores nothing
    assert anls("  new   york ", ["New York", "NYC"]) == 1.0  # best label, whitespace collapsed


def test_summary_uses_the_corpus_form(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path)).model_copy(update={"metrics": ["wer", "exact_match"]})
    samples = load_samples(spec)
    good = finish_record(spec, samples[0], "a0", Provenance(server_id="s1", attempts=1))
    bad = finish_record(spec, samples[1], None, Provenance(error="x", error_kind=ErrorKind.TIMEOUT))
    summary = summarize_records(spec, [good, bad])
    by_metric = {s["metric"]: s for s in summary["scores"]}
    assert by_metric["wer"]["value"] == pytest.approx(50.0)  # 0 + 1 edit over 1 + 1 words
    assert by_metric["exact_match"]["value"] == 50.0


def test_failed_records_count_as_wrong_not_dropped(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path))
    samples = load_samples(spec)
    good = finish_record(spec, samples[0], " a0\nmore", Provenance(server_id="s1", attempts=1))
    bad = finish_record(spec, samples[1], None, Provenance(error="all attempts failed", error_kind=ErrorKind.TIMEOUT))
    assert good.output.text.prediction_postprocessed == ["a0"] and good.metrics == {"exact_match": 1.0}
    assert bad.metrics == {"exact_match": 0.0} and bad.failed
    summary = summarize_records(spec, [good, bad])
    assert summary["scores"][0]["value"] == 50.0 and summary["failed"] == 1
    assert summary["errors"] == {"timeout": 1}


def test_request_body_for_completion_and_chat(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path))
    sample = load_samples(spec)[0]
    body = request_body(spec, sample)
    assert body["prompt"] == "Q: q0\nA:" and body["max_tokens"] == 4 and body["stop"] == ["\n"]
    chat = spec.model_copy(update={"prompt": spec.prompt.model_copy(update={"style": "chat", "system": "Be brief."})})
    body = request_body(chat, sample)
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: q0\nA:"}]


# ---- artifacts --------------------------------------------------------------------------------
def test_artifact_exactly_once_resume_and_torn_tail(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path))
    samples = load_samples(spec)
    config = {"fingerprint": "f1"}
    writer = ArtifactWriter(tmp_path / "out", config)
    rec0 = finish_record(spec, samples[0], "a0", Provenance())
    assert writer.write(rec0) is True
    assert writer.write(rec0) is False  # never twice
    writer.close()
    with (tmp_path / "out" / "records.jsonl").open("a") as fh:
        fh.write('{"benchmark": "tiny", "sample_id": "1", "mess')  # killed mid-write
    again = ArtifactWriter(tmp_path / "out", config)
    assert again.done_ids == {"0"} and again.resumed == 1
    assert again.write(finish_record(spec, samples[1], "a1", Provenance())) is True
    again.close()
    assert [r.sample_id for r in read_records(tmp_path / "out" / "records.jsonl")] == ["0", "1"]
    with pytest.raises(ArtifactError, match="another configuration"):
        ArtifactWriter(tmp_path / "out", {"fingerprint": "other"})


def test_secrets_never_reach_an_artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-live-abcdef123456")
    spec = load_spec(write_spec(tmp_path))
    sample = load_samples(spec)[0]
    writer = ArtifactWriter(tmp_path / "out", {"fingerprint": "x", "note": "key sk-live-abcdef123456"},
                            secrets=["registry-secret-token"])
    writer.write(finish_record(spec, sample, "leaked registry-secret-token", Provenance()))
    writer.close()
    writer.write_summary({"echo": "sk-live-abcdef123456"})
    for path in (tmp_path / "out").iterdir():
        text = path.read_text()
        assert "sk-live-abcdef123456" not in text and "registry-secret-token" not in text, path
    assert redact({"a": ["xx secret1 yy"]}, ["secret1"]) == {"a": ["xx *** yy"]}


@pytest.mark.parametrize(
    ("raw", "letter"),
    [(" Paris", "B"), (" paris, of course", "B"), ("B", "B"), ("The answer is (A)", "A"),
     (" Mexico City", "C"), (" Mexico", "D"), (" Lyon", ""), ("", "")],
)
def test_option_letter_maps_text_answers_to_their_option(raw: str, letter: str) -> None:
    fields = {"A": "Rome", "B": "Paris", "C": "Mexico City", "D": "Mexico"}  # longest matching option wins
    assert apply_postprocess(raw, ["option_letter"], fields) == letter


def test_verifier_parsing_cutting_and_inputs(tmp_path: Path) -> None:
    from fedpool.pipeline.verifier import (
        JudgeItem,
        cut_head_tail,
        judge_item,
        judge_prompt,
        parse_judgment,
        with_judgment,
    )

    assert parse_judgment(" Matches.\nRating: 1").rating == 1
    assert parse_judgment(" First said Rating: 1 then\nRating: 0\n").rating == 0  # the last one at a line end
    assert parse_judgment(" Rating: 1 is what I would say").rating is None  # not at a line end
    assert parse_judgment(" no verdict at all").rating is None
    cut = cut_head_tail("a" * 50 + "MIDDLE" + "z" * 50, 40)
    assert cut.startswith("aaaa") and cut.endswith("zzzz") and "MIDDLE" not in cut and len(cut) <= 40
    prompt = judge_prompt(JudgeItem("Q?", "ref", "pred " * 1000, ("A. x", "B. y")), field_chars=100)
    assert "Option: A. x" in prompt and prompt.endswith("Explanation:") and len(prompt) < 2000
    spec = load_spec(write_spec(tmp_path))
    record = finish_record(spec, load_samples(spec)[0], " a0", Provenance())
    item = judge_item(record)
    assert (item.question, item.reference, item.prediction) == ("Q: q0\nA:", "a0", " a0")
    judged = with_judgment(record, parse_judgment(" ok\nRating: 1"))
    unparsed = with_judgment(record, parse_judgment(" hmm"))
    assert judged.metrics["verifier"] == 1.0 and unparsed.metrics["verifier"] == 0.0
    verified = spec.model_copy(update={"verifier": True})
    summary = summarize_records(verified, [judged, unparsed])
    assert {s["metric"]: s["value"] for s in summary["scores"]}["verifier"] == 50.0
    assert summary["verifier_unparsed"] == 1  # counted and reported, and scored 0, never dropped


def test_replay_refuses_a_changed_dataset_and_rescore_redoes_scores(tmp_path: Path) -> None:
    import asyncio

    from fedpool.pipeline.loaders import dataset_sha256
    from fedpool.pipeline.reproduce import load_saved, rescore_benchmark

    spec = load_spec(write_spec(tmp_path))
    samples = load_samples(spec)
    config = {"fingerprint": "f", "benchmark": spec.model_dump(mode="json"), "model": "m", "revision": None,
              "dataset": {"path": str(spec.data_path()), "sha256": dataset_sha256(spec.data_path())}}
    writer = ArtifactWriter(tmp_path / "run" / spec.name, config)
    writer.write(finish_record(spec, samples[0], "A0 is it", Provenance(server_id="s", attempts=1)))
    writer.write(finish_record(spec, samples[1], None, Provenance(error="x", error_kind=ErrorKind.TIMEOUT)))
    writer.close()
    saved = load_saved(tmp_path / "run" / spec.name)
    assert saved.spec.prompt == spec.prompt and saved.spec.data_path() == spec.data_path()
    lenient = spec.model_copy(update={"postprocess": ["first_word", "lower"], "source_file": str(tmp_path / "s")})
    summary = asyncio.run(rescore_benchmark(saved, tmp_path / "rescored", spec=lenient))
    assert summary["records"] == 2 and summary["failed"] == 1
    assert summary["scores"][0]["value"] == 50.0  # "a0" now matches; the failed one stays wrong
    with (tmp_path / "data.jsonl").open("a") as fh:
        fh.write('{"id": 9, "question": "q", "answer": "a"}\n')
    with pytest.raises(ArtifactError, match="changed since the run"):
        load_saved(tmp_path / "run" / spec.name)


def test_the_artifact_names_every_package_that_can_change_a_score() -> None:
    from fedpool.pipeline.artifact import package_versions

    versions = package_versions()
    for name in ("fedpool", "jiwer", "sacrebleu", "rapidfuzz", "numpy", "scipy", "pydantic", "pyyaml"):
        assert name in versions, name


def test_one_vectorized_bootstrap_serves_means_and_corpus_statistics() -> None:
    import numpy as np

    from fedpool.pipeline.metrics import aggregate, aggregate_corpus, bootstrap

    rng = np.random.default_rng(1)
    values = rng.integers(0, 2, 400).astype(float)
    mean, lo, hi = bootstrap(values.reshape(-1, 1), lambda sums: sums[:, 0] / len(values), seed=3)
    se = values.std() / np.sqrt(len(values))
    assert mean == values.mean() and lo == pytest.approx(mean - 1.96 * se, abs=0.015)
    assert hi == pytest.approx(mean + 1.96 * se, abs=0.015)
    assert aggregate("exact_match", list(values), seed=3).ci_low == pytest.approx(100 * lo)
    # Same seed, same interval; a corpus statistic goes through the same resampling.
    wer = aggregate_corpus("wer", [("a b c", ["a b d"]), ("x", ["x y"]), ("", ["p q r s"])], seed=5)
    assert wer.value == pytest.approx(100 * (1 + 1 + 4) / 9) and wer.ci_low <= wer.value <= wer.ci_high
    assert aggregate_corpus("wer", [("a b c", ["a b d"]), ("x", ["x y"]), ("", ["p q r s"])], seed=5) == wer
