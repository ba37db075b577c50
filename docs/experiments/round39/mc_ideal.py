"""Round 39: where the simulator's ideal hit rate on the Mooncake workload exceeds the live driver's.
Both infinite caches see the same turns in the same order (each session's turns in turn, sessions
in the scenario's order); the live side hashes the driver's rendered text as the emulator does, the
simulator side names blocks as the simulator does. Prints hit tokens (model tokens) per kind of turn.
    PYTHONPATH=. python docs/experiments/round39/mc_ideal.py [SEED] [SESSIONS] [UNIT] [WORKLOAD]
(WORKLOAD: a name of loadtests.parity.WORKLOADS, default mooncake)"""
import json
import sys
from collections import defaultdict
from dataclasses import replace

from loadtests.ideal import InfiniteCache
from loadtests.live import rendered_turns
from loadtests.parity import WORKLOADS
from loadtests.scenario import DemoScenario, sim_config
from loadtests.sim.prompts import ChainNamer, IdealCache
from loadtests.workloads import turn_inputs

seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
unit = int(sys.argv[3]) if len(sys.argv) > 3 else DemoScenario().token_unit
work = sys.argv[4] if len(sys.argv) > 4 else "mooncake"
sc = replace(DemoScenario(), **WORKLOADS[work], kv_events=True, seed=seed, token_unit=unit)
cfg, specs = sim_config(sc)
page = cfg.profile.page_size
live = InfiniteCache(sc.page_size)  # the emulator's page, in emulated tokens
sim = IdealCache(page)
acc = defaultdict(lambda: [0, 0, 0, 0])  # kind -> [turns, prompt model tokens, sim hit, live hit (model)]
for uid, spec in enumerate(specs[:limit]):
    for chain in spec.walk():
        namer = ChainNamer(chain, uid, uid, page, cfg.turn_framing_tokens)
        inputs = turn_inputs(chain)
        for k, (conv, cont) in enumerate(rendered_turns(chain, sc.token_unit)):
            names = namer.names(k)
            s_hit = sim.hit_tokens(names, inputs[k])
            sim.add(namer.full_names(k, names))
            blocks, emul = live.blocks(conv.messages, conv.key)
            l_hit = live.hit(blocks, emul) * inputs[k] / max(1, emul)
            live.insert(blocks)
            kind = "first" if k == 0 else ("reset" if chain.turns[k].reset else "continuation")
            if k == 0:
                kind += "-shared" if chain.shared_prefix_tokens else "-solo"
            a = acc[kind]
            a[0] += 1; a[1] += inputs[k]; a[2] += s_hit; a[3] += l_hit
tot = [sum(a[i] for a in acc.values()) for i in range(4)]
for kind, a in sorted(acc.items()) + [("all", tot)]:
    print(json.dumps({"kind": kind, "turns": a[0], "prompt_tokens": a[1], "sim_hit": round(a[2] / a[1], 4),
                      "live_hit": round(a[3] / a[1], 4)}))
