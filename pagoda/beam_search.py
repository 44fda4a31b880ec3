"""Beam search on top of the engine, as vLLM does it: each step, every live beam is one request
for a single token with its top ``2 * beam_width`` logprobs; the candidates of all beams of a
prompt are ranked and the best ``beam_width`` go on. Each beam's request repeats its whole
history, and the prefix cache turns that into reusing the history's blocks: a step computes
about one block per beam, whatever the length.

Beams are ranked by length-penalised log-probability, ``cum_logprob / len ** length_penalty``,
with ``len`` counting the prompt (vLLM's rule) and not counting a final EOS.
"""
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from pagoda.outputs import BeamSearchOutput, BeamSearchSequence
from pagoda.sampling_params import BeamSearchParams, SamplingParams


def beam_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    n = len(beam.tokens) - (beam.tokens[-1] == eos_token_id)
    return beam.cum_logprob / (n ** length_penalty)


@dataclass
class _Instance:
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(llm, prompts: list, params: BeamSearchParams, use_tqdm: bool = False,
                lora_request=None) -> list[BeamSearchOutput]:
    tokenizer = llm.get_tokenizer()
    eos = llm.llm_engine.eos_token_id
    instances = [_Instance([BeamSearchSequence(llm.llm_engine.prompt_token_ids(p), [])]) for p in prompts]
    step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                                 ignore_eos=True, detokenize=False)

    def key(beam):
        return beam_score(beam, eos, params.length_penalty)

    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
        live = [(inst, beam) for inst in instances for beam in inst.beams]
        if not live:
            break
        outputs = llm.generate([{"prompt_token_ids": beam.tokens} for _, beam in live], step_params,
                               use_tqdm=False, lora_request=lora_request)
        candidates: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
        for (inst, beam), out in zip(live, outputs):
            top = out.outputs[0].logprobs[0]
            for token_id, lp in top.items():
                candidates[id(inst)].append(BeamSearchSequence(
                    beam.tokens + [token_id], beam.logprobs + [top], beam.cum_logprob + lp.logprob))
        for inst in instances:
            ranked = sorted(candidates[id(inst)], key=key, reverse=True)
            inst.beams = []
            for beam in ranked:
                if len(inst.beams) == params.beam_width:
                    break
                if beam.tokens[-1] == eos and not params.ignore_eos:
                    beam.finish_reason = "stop"
                    inst.completed.append(beam)
                else:
                    inst.beams.append(beam)

    results = []
    for inst in instances:
        for beam in inst.beams:
            beam.finish_reason = "length"
        best = sorted(inst.completed + inst.beams, key=key, reverse=True)[:params.beam_width]
        for beam in best:
            if tokenizer is not None:
                beam.text = tokenizer.decode(beam.tokens)
        results.append(BeamSearchOutput(best))
    return results
