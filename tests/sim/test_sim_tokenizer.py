"""A simulated worker tokenizes as the gateway does: the same ids for a text prompt and
for a chat (same template, same special tokens), hence the same block keys; generated
filler ids are ids of that vocabulary; the folder comes from the profile (any working
directory) or `--tokenizer`; torch is never imported.

The test may import both `router.intake.tokenize` and `workers`; the packages never import
each other."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from kvindex.keys import BlockHasher
from router.intake.tokenize import Tokenizer
from workers.cluster import SimCluster
from workers.sim.profile import CONFIGS_DIR, load_profile
from workers.sim.testing import make_profile
from workers.tokenizer import SimTokenizer, TokenizerError

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "tiny": ROOT / "configs" / "assets" / "tiny-tokenizer",
    "llama3-style": ROOT / "tests" / "data" / "tokenizers" / "llama3-style",
    "qwen2.5-style": ROOT / "tests" / "data" / "tokenizers" / "qwen2.5-style",
}
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is KV cache offloading?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour ! Ça va ? 漢字 🙂"},
        {"role": "assistant", "content": "Très bien.\n\nEt vous ?"},
        {"role": "user", "content": "  spaces  and\ttabs\n" * 20},
    ],
    [{"role": "user", "content": ""}],
]
TEXTS = [
    "hello",
    "hello there, simulated worker",
    "  leading and trailing spaces  ",
    "unicode: é, e\u0301, 漢字, 🙂",
    "a literal <|im_start|> and <|endoftext|> in the text",
    "line\n" * 300,
]


def gateway_chat_ids(gw: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """What the gateway sends for a chat (router/gateway.py: render, then encode without specials)."""
    return list(gw.encode_text(gw.render_chat(messages), False))


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_same_ids_as_the_gateway(name: str) -> None:
    gw, sim = Tokenizer(FOLDERS[name]), SimTokenizer(FOLDERS[name])
    for messages in CHATS:
        assert sim.apply_chat_template(messages) == gateway_chat_ids(gw, messages), messages
    for text in TEXTS:
        assert sim.encode(text) == list(gw.encode_text(text, True)), text


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_filler_ids_are_in_the_vocabulary(name: str) -> None:
    sim = SimTokenizer(FOLDERS[name])
    ids, text = sim.filler(0, 100)
    assert len(ids) == 100 and all(0 <= i < len(sim.hf) for i in ids)
    assert text == sim.decode(ids)
    # chunks of a stream concatenate to the whole
    head, rest = sim.filler(0, 37), sim.filler(37, 63)
    assert (head[0] + rest[0], head[1] + rest[1]) == (ids, text)
    assert sim.filler(5, 0) == ([], "")


def test_profile_tokenizer_folder_from_any_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    p = load_profile("tiny-cpu")
    assert p.tokenizer_dir() == CONFIGS_DIR / "assets" / "tiny-tokenizer" == FOLDERS["tiny"]
    assert (p.tokenizer_dir() / "tokenizer.json").is_file()
    # a profile file of one's own: a relative folder next to it wins
    shutil.copytree(FOLDERS["qwen2.5-style"], tmp_path / "tok")
    text = (ROOT / "configs" / "profiles" / "tiny-cpu.yaml").read_text()
    (tmp_path / "mine.yaml").write_text(text + "\ntokenizer: tok\n")
    assert load_profile(tmp_path / "mine.yaml").tokenizer_dir() == tmp_path / "tok"


def test_a_folder_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        SimTokenizer(tmp_path)


def test_the_simulated_tokenizer_never_imports_torch() -> None:
    code = (
        "import sys; from workers.tokenizer import SimTokenizer; "
        f"t = SimTokenizer({str(FOLDERS['llama3-style'])!r}); "
        "t.apply_chat_template([{'role': 'user', 'content': 'x'}]); t.decode(t.encode('x')); t.filler(0, 3); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


async def test_worker_over_http_keys_what_the_gateway_keys() -> None:
    """A chat and a text prompt sent as text to a simulated worker land under the block
    keys of the gateway's ids: the same ids sent afterwards are served from GPU."""
    gw = Tokenizer(FOLDERS["llama3-style"])
    prof = make_profile(block_size=4, gpu_blocks=400, max_context_tokens=4096, max_num_batched_tokens=2048)
    cluster = SimCluster(1, prof, tokenizer=FOLDERS["llama3-style"])
    await cluster.start()
    url = cluster.workers[0].url
    messages = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi there, how are you?"}]
    text = "Once upon a time, in a cache far away, " * 4
    cases = [
        ("/v1/chat/completions", {"messages": messages}, gateway_chat_ids(gw, [{**messages[0], "role": "system"},
                                                                              messages[1]])),
        ("/v1/completions", {"prompt": text}, list(gw.encode_text(text, True))),
    ]
    try:
        async with aiohttp.ClientSession() as http:
            for path, body, want in cases:
                async with http.post(url + path, json={**body, "max_tokens": 1}) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["usage"]["prompt_tokens"] == len(want)
                async with http.post(url + "/v1/completions", json={"prompt": want, "max_tokens": 1}) as r:
                    usage = (await r.json())["usage"]
                assert usage["prompt_tokens_details"]["cached_tokens"] == (len(want) - 1) // 4 * 4, path
        ns = prof.namespace()
        keys = BlockHasher.for_namespace(ns).keys_for(cases[0][2], ns.scoped())
        assert all(t is not None for t in cluster.workers[0].engine.match_tiers(keys[: (len(cases[0][2]) - 1) // 4]))
    finally:
        await cluster.stop()

