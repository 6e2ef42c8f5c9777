"""An `LLM(...)` engine's KV events heard by a SUB socket: BlockStored for a prompt's full blocks
(hashes chained parent -> child, the blocks' token ids) and, with a KV pool too small for every
prompt, BlockRemoved for evicted blocks; a router that applies the events ends up knowing exactly
the blocks the engine's prefix cache holds."""

from __future__ import annotations

import pytest
from kv_subscriber import Subscriber

from splitfuse.engine.block_manager import ROOT_HASH, chain_hash
from splitfuse.engine.sequence import SamplingParams
from splitfuse.kv_events.events import AllBlocksCleared, external_hash
from splitfuse.llm import LLM
from splitfuse.utils.ports import free_port

BLOCK = 4
PROMPTS = [[1 + p * 40 + i for i in range(22)] for p in range(5)]  # no prefix in common
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def heard(tiny_llama):
    """(the engine's cached hashes at the end, the messages heard), generating PROMPTS one by one
    through a 16-block pool (each prompt takes 7 blocks: later prompts evict earlier ones)."""
    llm = LLM(tiny_llama, block_size=BLOCK, num_kv_blocks=16, token_budget=32, max_model_len=48,
              attention_backend="torch", kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}")
    publisher = llm.engine.kv_event_publisher
    with Subscriber(publisher.endpoint) as sub:
        sub.join(lambda: publisher.publish([AllBlocksCleared()]))
        for prompt in PROMPTS:
            llm.generate([prompt], GREEDY)
        cached = {external_hash(h) for h in llm.engine.blocks._block_of_hash}
        llm.shutdown()
        messages = sub.until_quiet()
    return cached, messages


def test_first_prompt_is_stored_as_one_chain(heard):
    _, messages = heard
    assert messages[0].events[0] == ["AllBlocksCleared"]  # the engine's first step: its cache was empty
    assert {m.rank for m in messages} == {0}
    stored = [e for m in messages for e in m.events if e[0] == "BlockStored"]
    prompt = PROMPTS[0]
    hashes, parent = [], ROOT_HASH
    for i in range(len(prompt) // BLOCK):
        parent = chain_hash(parent, prompt[i * BLOCK : (i + 1) * BLOCK])
        hashes.append(external_hash(parent))
    first = stored[0]
    assert first[0:5] == ["BlockStored", hashes, None, prompt[: len(hashes) * BLOCK], BLOCK]
    assert first[5:] == [None, "GPU", None]  # lora_id, medium, lora_name
    # Generated tokens fill the next block later: its event hangs on the prompt's last block.
    follow = stored[1]
    assert follow[2] == hashes[-1] and follow[3][:2] == prompt[-2:] and len(follow[3]) == BLOCK


def test_evictions_are_removed_and_a_router_view_matches_the_cache(heard):
    cached, messages = heard
    seqs = [m.seq for m in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # none dropped
    view: set[int] = set()
    removed = 0
    for message in messages:
        for event in message.events:
            if event[0] == "BlockStored":
                assert not view & set(event[1]), "a block stored twice without removal"
                view |= set(event[1])
            elif event[0] == "BlockRemoved":
                assert set(event[1]) <= view, "removed a block never stored"
                view -= set(event[1])
                removed += len(event[1])
            else:
                assert event == ["AllBlocksCleared"]
                view.clear()
    assert removed > 0
    assert view == cached


def test_a_taken_endpoint_fails_the_engine_naming_it(tiny_llama):
    import zmq

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    taken.bind(endpoint)
    try:
        with pytest.raises(ValueError, match="kv_events_endpoint: cannot bind"):
            LLM(tiny_llama, num_kv_blocks=16, attention_backend="torch", kv_events_endpoint=endpoint)
    finally:
        taken.close(linger=0)
        context.term()


def test_blocks_offloaded_to_the_host_tier_are_stored_there_as_cpu(tiny_llama):
    """With kv_offload_memory_gb, every block the pool evicts is copied down to the host-RAM tier:
    a BlockStored of medium CPU for each pool BlockRemoved, the hash alone (the tier keeps no tokens)."""
    llm = LLM(tiny_llama, block_size=BLOCK, num_kv_blocks=16, token_budget=32, max_model_len=48,
              attention_backend="torch", kv_offload_memory_gb=0.01,
              kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}")
    publisher = llm.engine.kv_event_publisher
    with Subscriber(publisher.endpoint) as sub:
        sub.join(lambda: publisher.publish([AllBlocksCleared()]))
        for prompt in PROMPTS:
            llm.generate([prompt], GREEDY)
        llm.shutdown()
        events = [e for m in sub.until_quiet() for e in m.events]
    evicted = [h for e in events if e[0] == "BlockRemoved" and e[2] == "GPU" for h in e[1]]
    offloaded = [e for e in events if e[0] == "BlockStored" and e[6] == "CPU"]
    assert evicted and sorted(h for e in offloaded for h in e[1]) == sorted(evicted)
    assert all(e[2] is None and e[3] == [] and e[4] == BLOCK for e in offloaded)
