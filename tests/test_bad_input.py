"""The bad-input catalogue: each case across the surfaces (dataset rows, benchmark specs, config files, CLI
flags, registrations, REST bodies, server responses, media, artifacts) must be answered with a clear,
typed error that names its culprit (file and line, field, server, sample), never a bare traceback; and
property-based tests over the record and spec parsers (hypothesis)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from fedpool.clients.jobs import JobRequest, resolve_specs
from fedpool.federation import Endpoint
from fedpool.federation.errors import AttemptError, FailureKind
from fedpool.federation.transport import parse_completion
from fedpool.pipeline import ArtifactWriter, DataError, SpecError, load_samples, load_spec, spec_from_dict
from fedpool.pipeline.errors import ArtifactError, PipelineError
from fedpool.pipeline.media import encode_sample
from fedpool.pipeline.schema import Record
from fedpool.pipeline.spec import MediaSpec
from fedpool.registry import ServerRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fedpool.config import ConfigError, apply_defaults, read_config_file

ROOT = Path(__file__).resolve().parent.parent
SPEC = "name: t\ndata: {path: d.jsonl}\nprompt: {template: 'Q: {q}'}\n"
GOOD_ROW = {"id": 1, "q": "x", "answer": "y"}


def spec_with_rows(tmp: Path, *lines: str, spec: str = SPEC, data: str = "d.jsonl") -> Path:
    (tmp / data).write_text("".join(line + "\n" for line in lines))
    (tmp / "s.yaml").write_text(spec)
    return tmp / "s.yaml"


def rows_error(tmp: Path, *lines: str) -> str:
    with pytest.raises(DataError) as err:
        load_samples(load_spec(spec_with_rows(tmp, *lines)))
    return str(err.value)


def spec_error(tmp: Path, text: str) -> str:
    (tmp / "s.yaml").write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(tmp / "s.yaml")
    return str(err.value)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedpool.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def validation(fn: Callable[[], object]) -> str:
    with pytest.raises(ValidationError) as err:
        fn()
    return str(err.value)


def response_error(raw: bytes, endpoint: Endpoint = Endpoint.COMPLETIONS) -> str:
    with pytest.raises(AttemptError) as err:
        parse_completion(raw, endpoint)
    assert err.value.kind is FailureKind.BAD_RESPONSE
    return str(err.value)


def config_error(tmp: Path, text: str, name: str = "c.toml") -> str:
    from fedpool.cli import build_parser

    (tmp / name).write_text(text)
    with pytest.raises(ConfigError) as err:
        apply_defaults(build_parser(), read_config_file(tmp / name), tmp / name, {})
    return str(err.value)


def media_error(tmp: Path, name: str, content: bytes | None, kind: str = "image") -> str:
    if content is not None:
        (tmp / name).write_bytes(content)
    with pytest.raises(DataError) as err:
        encode_sample([MediaSpec(field="f", type=kind)], {"f": name}, tmp, "s7")  # type: ignore[arg-type]
    return str(err.value)


# (surface, case, produce the error text, fragments the text must contain)
Case = tuple[str, str, Callable[[Path], str], tuple[str, ...]]
CASES: list[Case] = [
    ("dataset row", "malformed JSON", lambda t: rows_error(t, json.dumps(GOOD_ROW), "{oops"),
     ("d.jsonl:2", "malformed JSON")),
    ("dataset row", "not an object", lambda t: rows_error(t, "[1, 2]"), ("d.jsonl:1", "not an object")),
    ("dataset row", "missing template field", lambda t: rows_error(t, '{"id": 1, "answer": "a"}'),
     ("d.jsonl:1", "'q'")),
    ("dataset row", "wrong type", lambda t: rows_error(t, '{"id": 1, "q": {"x": 1}, "answer": "a"}'),
     ("d.jsonl:1", "'q' must be text")),
    ("dataset row", "null field", lambda t: rows_error(t, '{"id": 1, "q": null, "answer": "a"}'), ("'q'", "null")),
    ("dataset row", "empty file", lambda t: rows_error(t), ("d.jsonl", "no samples")),
    ("dataset row", "huge row", lambda t: rows_error(t, json.dumps({**GOOD_ROW, "q": "x" * (9 * 2**20)})),
     ("d.jsonl:1", "larger than")),
    ("dataset row", "missing label", lambda t: rows_error(t, '{"id": 1, "q": "x"}'), ("d.jsonl:1", "'answer'")),
    ("dataset row", "boolean label", lambda t: rows_error(t, '{"id": 1, "q": "x", "answer": true}'),
     ("d.jsonl:1", "label field")),
    ("dataset row", "duplicate id", lambda t: rows_error(t, json.dumps(GOOD_ROW), json.dumps(GOOD_ROW)),
     ("d.jsonl:2", "duplicate id '1'")),
    ("dataset row", "bad id type", lambda t: rows_error(t, '{"id": [1], "q": "x", "answer": "a"}'),
     ("d.jsonl:1", "id field")),
    ("benchmark spec", "unknown metric", lambda t: spec_error(t, SPEC + "metrics: [vibes]\n"), ("s.yaml", "vibes")),
    ("benchmark spec", "label shown in the prompt",
     lambda t: spec_error(t, SPEC.replace("{q}", "{answer}")), ("s.yaml", "label field")),
    ("benchmark spec", "broken template", lambda t: spec_error(t, SPEC.replace("{q}", "{q")), ("s.yaml", "template")),
    ("benchmark spec", "YAML syntax", lambda t: spec_error(t, "name: t\ndata: {path: [\n"), ("s.yaml",)),
    ("benchmark spec", "not a mapping", lambda t: spec_error(t, "- 1\n- 2\n"), ("s.yaml", "mapping")),
    ("benchmark spec", "unknown key", lambda t: spec_error(t, SPEC + "temperature: 0.5\n"), ("s.yaml", "temperature")),
    ("benchmark spec", "media without chat",
     lambda t: spec_error(t, SPEC.replace("template: 'Q: {q}'",
                                          "template: 'Q: {q}', media: [{field: im, type: image}]")),
     ("s.yaml", "style: chat")),
    ("benchmark spec", "bad name", lambda t: spec_error(t, SPEC.replace("name: t", "name: 'bad name!'")),
     ("s.yaml", "name")),
    ("config file", "unknown option", lambda t: config_error(t, "porty = 1\n"), ("c.toml", "porty")),
    ("config file", "not TOML", lambda t: config_error(t, "port = [\n"), ("c.toml", "not valid TOML")),
    ("config file", "value outside choices", lambda t: config_error(t, "policy = 'fastest'\n"),
     ("c.toml", "policy", "fastest")),
    ("config file", "unknown command table", lambda t: config_error(t, "[gatway]\nport = 1\n"), ("c.toml", "gatway")),
    ("CLI flag", "zero servers", lambda t: cli("demo", "--servers", "0").stderr, ("--servers", ">= 1")),
    ("CLI flag", "unknown policy", lambda t: cli("eval", "run", "--policy", "x").stderr, ("--policy", "'x'")),
    ("CLI flag", "missing required", lambda t: cli("server", "add", "--id", "x").stderr, ("--url",)),
    ("registration", "bad URL", lambda t: validation(lambda: ServerRecord(id="a", url="ftp://x", engine="vllm",
                                                                          model="m")), ("url",)),
    ("registration", "unknown engine", lambda t: validation(lambda: ServerRecord(id="a", url="http://x:1",
                                                                                 engine="tgi", model="m")),
     ("engine",)),
    ("registration", "bad id", lambda t: validation(lambda: ServerRecord(id="a b", url="http://x:1", engine="vllm",
                                                                         model="m")), ("id",)),
    ("REST body", "job concurrency 0", lambda t: validation(lambda: JobRequest(model="m", concurrency=0)),
     ("concurrency",)),
    ("REST body", "job with an unknown field", lambda t: validation(lambda: JobRequest.model_validate(
        {"model": "m", "priority": 1})), ("priority",)),
    ("REST body", "job without specs", lambda t: _raises(PipelineError, lambda: resolve_specs(JobRequest(model="m"))),
     ("specs",)),
    ("REST body", "inline spec with a relative data path", lambda t: _raises(PipelineError, lambda: resolve_specs(
        JobRequest(model="m", specs=[{"name": "t", "data": {"path": "d.jsonl"}, "prompt": {"template": "{q}"}}]))),
     ("'t'", "must be absolute")),
    ("server response", "truncated body", lambda t: response_error(b'{"choices": [{"text": '), ("not JSON",)),
    ("server response", "no choices", lambda t: response_error(b'{"id": "x"}'), ("no choices",)),
    ("server response", "chat without message", lambda t: response_error(b'{"choices": [{"text": "a"}]}',
                                                                          Endpoint.CHAT), ("no message",)),
    ("server response", "text not a string", lambda t: response_error(b'{"choices": [{"text": 3}]}'),
     ("no text",)),
    ("media", "missing image", lambda t: media_error(t, "gone.png", None), ("gone.png", "'s7'", "does not exist")),
    ("media", "bytes not an image", lambda t: media_error(t, "x.png", b"hello"), ("x.png", "not a image/png")),
    ("media", "unreadable WAV", lambda t: media_error(t, "a.wav", b"RIFFnope", "audio"), ("a.wav", "WAV")),
    ("artifact", "resume with another configuration", lambda t: _resume_other_config(t), ("config.json",
                                                                                         "fingerprint")),
]


def _raises(kind: type[Exception], fn: Callable[[], object]) -> str:
    with pytest.raises(kind) as err:
        fn()
    return str(err.value)


def _resume_other_config(tmp: Path) -> str:
    ArtifactWriter(tmp / "a", {"fingerprint": "one"}).close()
    return _raises(ArtifactError, lambda: ArtifactWriter(tmp / "a", {"fingerprint": "two"}))


def test_the_catalogue_has_at_least_30_cases_over_every_surface() -> None:
    assert len(CASES) >= 30
    assert {c[0] for c in CASES} >= {"dataset row", "benchmark spec", "config file", "CLI flag", "registration",
                                     "REST body", "server response"}


@pytest.mark.parametrize(("surface", "case", "produce", "fragments"), CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_bad_input_names_its_culprit(tmp_path: Path, surface: str, case: str, produce: Callable[[Path], str],
                                     fragments: tuple[str, ...]) -> None:
    message = produce(tmp_path)
    assert "Traceback" not in message
    for fragment in fragments:
        assert fragment in message, (surface, case, message)


# ---- property-based: the parsers take anything and answer with their own typed errors ------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.one_of(st.text(max_size=40), json_values.map(json.dumps),
                               st.fixed_dictionaries({"id": json_values, "q": json_values, "answer": json_values}
                                                     ).map(json.dumps)), max_size=8))
def test_dataset_rows_fuzzed(tmp_path: Path, rows: list[str]) -> None:
    lines = [r.replace("\n", " ").replace("\r", " ") for r in rows]
    try:
        samples = load_samples(load_spec(spec_with_rows(tmp_path, *lines)))
    except DataError as exc:
        assert str(tmp_path / "d.jsonl") in str(exc)
        return
    ids = [s.sample_id for s in samples]
    assert len(ids) == len(set(ids)) and all(ids) and all(s.labels for s in samples)


@settings(max_examples=200, deadline=None)
@given(raw=st.dictionaries(st.sampled_from(["name", "data", "prompt", "metrics", "postprocess", "generation",
                                            "verifier", "label_field", "extra"]), json_values, max_size=6))
def test_spec_parser_fuzzed(raw: dict[str, object]) -> None:
    try:
        spec = spec_from_dict(raw, source="fuzz.yaml")
    except SpecError as exc:
        assert str(exc).startswith("fuzz.yaml:")
        return
    assert spec.name and spec.metrics


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(max_size=200), json_values.map(json.dumps)))
def test_record_parser_fuzzed(text: str) -> None:
    try:
        Record.model_validate_json(text)
    except ValidationError:
        return


@settings(max_examples=200, deadline=None)
@given(raw=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())))
def test_server_response_parser_fuzzed(raw: bytes) -> None:
    for endpoint in (Endpoint.COMPLETIONS, Endpoint.CHAT):
        try:
            completion = parse_completion(raw, endpoint)
        except AttemptError as exc:
            assert exc.kind is FailureKind.BAD_RESPONSE
            continue
        assert isinstance(completion.text, str)
