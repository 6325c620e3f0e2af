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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fedpool.clients.jobs import JobRequest, resolve_specs
from fedpool.config import ConfigError, apply_defaults, read_config_file
from fedpool.federation import Endpoint
from fedpool.federation.core.errors import AttemptError, FailureKind
from fedpool.federation.gateway.transport import parse_completion
from fedpool.pipeline import (
    ArtifactWriter,
    DataError,
    SpecError,
    load_samples,
    load_spec,
    spec_from_dict,
    unique_records,
)
from fedpool.pipeline.errors import ArtifactError, OwnershipError, PipelineError
from fedpool.pipeline.media import encode_sample
from fedpool.pipeline.schema import Record
from fedpool.pipeline.spec import MediaSpec
from fedpool.registry import Engine, ServerRecord

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


def _cli_fails(*args: str, code: int = 2) -> str:
    done = cli(*args)
    assert done.returncode == code, (args, done.returncode, done.stderr)
    return done.stderr


def _non_utf8_spec(tmp: Path) -> str:
    (tmp / "s.yaml").write_bytes(b"name: t\xff\xfe\n")
    return _raises(SpecError, lambda: load_spec(tmp / "s.yaml"))


def _spec_is_a_directory(tmp: Path) -> str:
    (tmp / "s.yaml").mkdir()
    return _raises(SpecError, lambda: load_spec(tmp / "s.yaml"))


def _non_utf8_config(tmp: Path) -> str:
    (tmp / "c.toml").write_bytes(b"port = 1\xff\n")
    return _raises(ConfigError, lambda: read_config_file(tmp / "c.toml"))


def _config_is_a_directory(tmp: Path) -> str:
    (tmp / "c.toml").mkdir()
    return _raises(ConfigError, lambda: read_config_file(tmp / "c.toml"))


def _non_utf8_csv(tmp: Path) -> str:
    (tmp / "d.csv").write_bytes(b"id,q,answer\n1,x,y\n2,\xff\xfe,z\n")
    (tmp / "s.yaml").write_text(SPEC.replace("d.jsonl", "d.csv"))
    return _raises(DataError, lambda: load_samples(load_spec(tmp / "s.yaml")))


def _run_args(tmp: Path, *extra: str, spec: str | None = None) -> list[str]:
    spec_path = str(spec_with_rows(tmp, json.dumps(GOOD_ROW))) if spec is None else spec
    return ["eval", "run", "--spec", spec_path, "--model", "m", "--out", str(tmp / "out"), *extra]


def _same_spec_twice(tmp: Path) -> str:
    args = _run_args(tmp)
    return _cli_fails(*args, "--spec", args[3])


def _spec_given_as_directory(tmp: Path) -> str:
    return _cli_fails(*_run_args(tmp, spec=str(tmp)))


def _reserved_benchmark_name(tmp: Path) -> str:
    spec = spec_with_rows(tmp, json.dumps(GOOD_ROW), spec=SPEC.replace("name: t", "name: eval.json"))
    message = _cli_fails(*_run_args(tmp, spec=str(spec)))
    assert not (tmp / "out").exists()  # refused before anything was written
    return message


def _missing_data_leaves_nothing(tmp: Path) -> str:
    (tmp / "s.yaml").write_text(SPEC)  # its d.jsonl does not exist
    message = _cli_fails(*_run_args(tmp, spec=str(tmp / "s.yaml")))
    assert not (tmp / "out").exists()  # no eval.json to block the next try
    return message


def _out_is_a_file(tmp: Path) -> str:
    args = _run_args(tmp)
    (tmp / "out").write_text("not a directory")
    return _cli_fails(*args)


def _resume_without_plan(tmp: Path) -> str:
    (tmp / "run").mkdir()
    return _cli_fails("eval", "resume", str(tmp / "run"))


def _resume_run_killed_before_writing(tmp: Path) -> str:
    (tmp / "run").mkdir()
    (tmp / "run" / ".fedpool.lock").write_text("")  # all a run killed at its first step leaves
    return _cli_fails("eval", "resume", str(tmp / "run"))


def _resume_damaged_plan(tmp: Path) -> str:
    (tmp / "run").mkdir()
    (tmp / "run" / "eval.json").write_text('{"specs": [')
    return _cli_fails("eval", "resume", str(tmp / "run"))


def _writer_on(tmp: Path, lines: list[str]) -> str:
    bench = tmp / "a"
    ArtifactWriter(bench, {"fingerprint": "f"}).close()
    (bench / "records.jsonl").write_text("".join(line + "\n" for line in lines))
    return _raises(ArtifactError, lambda: ArtifactWriter(bench, {"fingerprint": "f"}))


def _non_utf8_record_line(tmp: Path) -> str:
    bench = tmp / "a"
    ArtifactWriter(bench, {"fingerprint": "f"}).close()
    (bench / "records.jsonl").write_bytes(_record_line("1").encode() + b"\n\xff\xfe{}\n")
    return _raises(ArtifactError, lambda: ArtifactWriter(bench, {"fingerprint": "f"}))


def _record_line(sample_id: str) -> str:
    return Record(benchmark="t", sample_id=sample_id, messages=[], label=["y"]).model_dump_json()


def _damaged_config_json(tmp: Path) -> str:
    bench = tmp / "a"
    ArtifactWriter(bench, {"fingerprint": "f"}).close()
    (bench / "config.json").write_bytes(b"\x00\x01 not json")
    return _raises(ArtifactError, lambda: ArtifactWriter(bench, {"fingerprint": "f"}))


def _owned_elsewhere(tmp: Path) -> str:
    holder = ArtifactWriter(tmp / "a", {"fingerprint": "f"})
    try:
        return _raises(OwnershipError, lambda: ArtifactWriter(tmp / "a", {"fingerprint": "f"}))
    finally:
        holder.close()


def _rescore_garbage(tmp: Path) -> str:
    spec = load_spec(spec_with_rows(tmp, json.dumps(GOOD_ROW)))
    config = {"fingerprint": "f", "benchmark": spec.model_dump(mode="json"),
              "dataset": {"path": str(spec.data_path()), "sha256": "x"}}
    bench = tmp / "a"
    ArtifactWriter(bench, config).close()
    (bench / "records.jsonl").write_text(_record_line("1") + "\n{garbage\n")
    return _cli_fails("eval", "rescore", str(bench), "--out", str(tmp / "re"))


def _reported(tmp: Path, lines: list[str]) -> str:
    path = tmp / "records.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    counted = unique_records(path, ["1", "2"])
    return "; ".join([*(f"duplicate {w}" for w in counted.duplicates), *(f"foreign {w}" for w in counted.foreign)])


def _job_spec_outside(tmp: Path, path: str) -> str:
    return _raises(PipelineError, lambda: resolve_specs(JobRequest(model="m", spec_paths=[path]), roots=[tmp]))


def _job_spec_dir(tmp: Path) -> str:
    (tmp / "dir.yaml").mkdir()
    return _raises(PipelineError, lambda: resolve_specs(JobRequest(model="m", spec_paths=[str(tmp / "dir.yaml")]),
                                                        roots=[tmp]))


def _job_spec_invalid(tmp: Path) -> str:
    (tmp / "bad.yaml").write_text("secret_field_xyz: 1\n")
    message = _raises(PipelineError, lambda: resolve_specs(JobRequest(model="m", spec_paths=[str(tmp / "bad.yaml")]),
                                                           roots=[tmp]))
    assert "secret_field_xyz" not in message  # a spec file's content is never echoed
    return message


def _job_data_outside(tmp: Path) -> str:
    inline = {"name": "t", "data": {"path": "/etc/hostname"}, "prompt": {"template": "{q}"}}
    return _raises(PipelineError, lambda: resolve_specs(JobRequest(model="m", specs=[inline]), roots=[tmp / "r"]))


def _short_jobs_token(tmp: Path) -> str:
    from fedpool.clients.jobs import ensure_jobs_token

    return _raises(PipelineError, lambda: ensure_jobs_token(tmp, "five5"))


def _short_registry_token(tmp: Path) -> str:
    from fedpool.registry.auth import ensure_token
    from fedpool.registry.errors import AuthError

    return _raises(AuthError, lambda: ensure_token(tmp, "short-token"))


def _api_keys(text: str) -> str:
    from fedpool.federation.gateway.handlers import parse_api_keys

    return _raises(ValueError, lambda: parse_api_keys(text))


def _request_field(body: dict[str, object]) -> str:
    from fedpool.federation import InferenceRequest

    return _raises(ValueError, lambda: InferenceRequest.from_body({"prompt": "q", **body}, request_id="r", model="m",
                                                                  endpoint=Endpoint.COMPLETIONS))


def _upstream_reason() -> str:
    from fedpool.federation.gateway.unpooled import http_error

    raw = (b'{"error": {"code": 400, "message": "request (1502 tokens) exceeds the available context size (1024 '
           b'tokens), try increasing it", "type": "exceed_context_size_error"}}')
    err = http_error(400, raw)
    assert err.kind is FailureKind.REQUEST_ERROR
    return str(err)


def _env_file(tmp: Path, text: str) -> str:
    (tmp / "engine.env").write_text(text)
    return _cli_fails("serve", "--engine", "emulated", "--model", "m", "--env-file", str(tmp / "engine.env"))


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
    ("registration", "bad URL", lambda t: validation(lambda: ServerRecord(id="a", url="ftp://x", engine=Engine.VLLM,
                                                                          model="m")), ("url",)),
    ("registration", "unknown engine", lambda t: validation(lambda: ServerRecord.model_validate(
        {"id": "a", "url": "http://x:1", "engine": "tgi", "model": "m"})), ("engine",)),
    ("registration", "bad id", lambda t: validation(lambda: ServerRecord(id="a b", url="http://x:1", engine=Engine.VLLM,
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
    # Files that are not what they must be
    ("benchmark spec", "not UTF-8", _non_utf8_spec, ("s.yaml", "not UTF-8")),
    ("benchmark spec", "a directory", _spec_is_a_directory, ("s.yaml", "is a directory")),
    ("config file", "not UTF-8", _non_utf8_config, ("c.toml", "not UTF-8")),
    ("config file", "a directory", _config_is_a_directory, ("c.toml", "is a directory")),
    ("dataset row", "CSV not UTF-8", _non_utf8_csv, ("d.csv:3", "not UTF-8")),
    # The command line, checked before anything is written
    ("CLI flag", "port out of range", lambda t: cli("gateway", "--port", "70000").stderr, ("--port", "1 to 65535")),
    ("CLI flag", "port not a number", lambda t: cli("jobs", "serve", "--port", "http").stderr, ("--port", "'http'")),
    ("CLI flag", "wait for servers negative", lambda t: cli(*_run_args(t, "--wait-for-servers", "-1")).stderr,
     ("--wait-for-servers", "0 to 86400")),
    ("CLI flag", "the same --spec twice", _same_spec_twice, ("s.yaml", "given twice")),
    ("CLI flag", "a directory as --spec", _spec_given_as_directory, ("is a directory",)),
    ("CLI flag", "a benchmark named eval.json", _reserved_benchmark_name, ("'eval.json'", "run directory")),
    ("CLI flag", "missing data file: nothing written", _missing_data_leaves_nothing, ("d.jsonl", "does not exist")),
    ("CLI flag", "--out is a file", _out_is_a_file, ("out", "not a directory")),
    ("CLI flag", "resume a directory without a run", _resume_without_plan, ("run", "no eval.json")),
    ("CLI flag", "resume a run killed before it wrote anything", _resume_run_killed_before_writing,
     ("nothing to resume", "fedpool eval run --out")),
    ("CLI flag", "resume a damaged eval.json", _resume_damaged_plan, ("eval.json", "damaged")),
    ("CLI flag", "--env-file line without =", lambda t: _env_file(t, "HF_TOKEN\n"), ("engine.env:1", "KEY=VALUE")),
    ("CLI flag", "--env naming an unset variable",
     lambda t: _cli_fails("serve", "--engine", "emulated", "--model", "m", "--env", "FEDPOOL_SURELY_UNSET_X"),
     ("--env FEDPOOL_SURELY_UNSET_X", "no such variable")),
    # Artifacts on disk
    ("artifact", "a garbage line in records.jsonl", lambda t: _writer_on(t, [_record_line("1"), "{garbage"]),
     ("records.jsonl:2", "not JSON")),
    ("artifact", "JSON that is not a record", lambda t: _writer_on(t, ['{"hello": 1}']),
     ("records.jsonl:1", "not a record")),
    ("artifact", "bytes that are not UTF-8", _non_utf8_record_line, ("records.jsonl:2", "not JSON")),
    ("artifact", "a damaged config.json", _damaged_config_json, ("config.json", "not a fedpool configuration")),
    ("artifact", "a directory another process writes", _owned_elsewhere, ("in use by pid",)),
    ("artifact", "rescore over a garbage line", _rescore_garbage, ("records.jsonl:2", "not JSON")),
    ("artifact", "a second record of a sample", lambda t: _reported(t, [_record_line("1"), _record_line("1")]),
     ("duplicate", "records.jsonl:2")),
    ("artifact", "a record not in the dataset", lambda t: _reported(t, [_record_line("1"), _record_line("zz")]),
     ("foreign", "records.jsonl:2")),
    # The jobs API's files
    ("REST body", "spec path outside the roots", lambda t: _job_spec_outside(t, "/etc/shadow"),
     ("spec_paths[0]", "outside the directories")),
    ("REST body", "spec path escaping a root by ..", lambda t: _job_spec_outside(t, str(t / ".." / "x.yaml")),
     ("spec_paths[0]", "outside")),
    ("REST body", "spec path is a directory", _job_spec_dir, ("spec_paths[0]", "not a file")),
    ("REST body", "spec file that is no spec (content not echoed)", _job_spec_invalid,
     ("spec_paths[0]", "not a valid benchmark spec")),
    ("REST body", "inline data path outside the roots", _job_data_outside, ("data.path", "outside")),
    ("REST body", "job waiting a negative time", lambda t: validation(lambda: JobRequest(
        model="m", wait_for_servers_s=-1)), ("wait_for_servers_s",)),
    ("REST body", "max_tokens as text", lambda t: _request_field({"max_tokens": "8"}), ("'max_tokens'", "integer")),
    ("REST body", "stop of numbers", lambda t: _request_field({"stop": [1, 2]}), ("'stop'",)),
    ("REST body", "temperature a boolean", lambda t: _request_field({"temperature": True}), ("'temperature'",)),
    # Credentials
    ("credentials", "a 5-character jobs token", _short_jobs_token, ("at least 16", "has 5")),
    ("credentials", "a short registry token", _short_registry_token, ("at least 16",)),
    ("credentials", "two clients with one API secret",
     lambda t: _api_keys("a:sk-0123456789abcdef\nb:sk-0123456789abcdef\n"), ("line 2", "same secret as line 1")),
    ("credentials", "a short API secret", lambda t: _api_keys("a:sk-short\n"), ("line 1", "16")),
    ("registration", "accelerator with shell syntax", lambda t: validation(lambda: ServerRecord(
        id="a", url="http://x:1", engine=Engine.VLLM, model="m", accelerator="A100; rm -rf /")),
     ("not a device name",)),
    ("registration", "accelerator too long", lambda t: validation(lambda: ServerRecord(
        id="a", url="http://x:1", engine=Engine.VLLM, model="m", accelerator="X" * 40)), ("accelerator",)),
    ("server response", "a 400's reason is kept", lambda t: _upstream_reason(),
     ("request_error", "exceeds the available context size")),
]


def _raises(kind: type[Exception], fn: Callable[[], object]) -> str:
    with pytest.raises(kind) as err:
        fn()
    return str(err.value)


def _resume_other_config(tmp: Path) -> str:
    ArtifactWriter(tmp / "a", {"fingerprint": "one"}).close()
    return _raises(ArtifactError, lambda: ArtifactWriter(tmp / "a", {"fingerprint": "two"}))


def test_the_catalogue_has_at_least_60_cases_over_every_surface() -> None:
    assert len(CASES) >= 60
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
