"""LoRA adapters: a request naming an adapter as its `model` goes only to the workers that
list it in their `/v1/models` (as vLLM and our engine list adapters: `parent` = the base
model), under the adapter's name, keyed in the adapter's own namespace."""
from __future__ import annotations

from array import array

import aiohttp
import openai
import pytest
from fakes import FakeWorker
from gateway_fleet import DIGEST, MODEL, _cfg, client, fleet, wait_until

CHAT = [{"role": "user", "content": "Write a query."}]


@pytest.mark.parametrize("kind", ["vllm", "kvroute"])
async def test_an_adapter_request_goes_to_the_workers_that_have_it(kind: str) -> None:
    with_sql, plain = FakeWorker("a", DIGEST, adapters=("sql",), kind=kind), FakeWorker("b", DIGEST, kind=kind)
    async with fleet([with_sql, plain], _cfg(routing={"policy": "round_robin"})) as (gw, url):
        await wait_until(lambda: gw.pool.workers["a"].adapters == {"sql"}, 5.0, "the adapter listed")
        c = client(url)
        for _ in range(4):
            await c.chat.completions.create(model="sql", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert len(with_sql.completions) == 4 and not plain.completions
        assert {b["model"] for b in with_sql.completions} == {"sql"}  # the adapter's name goes upstream
        for _ in range(4):  # the base model still goes anywhere
            await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert plain.completions and {b["model"] for b in plain.completions} == {MODEL}
        ids = [m.id for m in (await c.models.list()).data]
        assert "sql" in ids and MODEL in ids
        async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
            cards = {m["id"]: m for m in (await r.json())["data"]}
        assert cards["sql"]["parent"] == MODEL
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="nosuch", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]


async def test_an_adapters_blocks_never_match_the_base_models() -> None:
    async with fleet([FakeWorker("a", DIGEST, adapters=("sql",))]) as (gw, _):
        rt = gw.models.get(MODEL)
        ids = array("I", range(100, 164))
        base, sql, other = (rt.key_plan(ids, "", None, lora) for lora in (None, "sql", "chat"))
        assert len({base.digests[0], sql.digests[0], other.digests[0]}) == 3
        assert rt.key_plan(ids, "", None, "sql").digests == sql.digests  # stable per adapter


async def test_an_adapter_no_healthy_worker_has_is_a_503() -> None:
    a = FakeWorker("a", DIGEST, adapters=("sql",))
    async with fleet([a, FakeWorker("b", DIGEST)]) as (gw, url):
        await wait_until(lambda: "sql" in gw.models.get(MODEL).adapters, 5.0, "the adapter listed")
        await gw.pool.remove("a")
        with pytest.raises(openai.APIStatusError) as ei:
            await client(url).chat.completions.create(model="sql", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert ei.value.status_code == 503 and "adapter 'sql'" in ei.value.message
