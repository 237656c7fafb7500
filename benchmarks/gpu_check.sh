#!/usr/bin/env bash
# GPU check of the decode fast path, for a machine with one CUDA device; under 18 minutes for every step. From the
# repository root, in an environment with the project installed (pip install -e ".[pipeline,test]"):
#
#     bash benchmarks/gpu_check.sh                  # every step; logs in $OUT (default: a new temporary directory)
#     bash benchmarks/gpu_check.sh graphs job       # only the named steps
#
# Steps (each under its own time limit), in this order:
#   real_size: benchmarks/real_size.py --device cuda, first: the published models' dimensions (Qwen2-VL-2B and
#      Qwen3-VL-2B whole, LLaVA-NeXT-Mistral-7B's whole 32-layer decoder) on DetailCaps-resolution images, written
#      under $OUT/real_size (24 GB of random bf16 weights); visual tokens, prefill, decode ms/token of full, bacon,
#      rcr, quest, infinigen against the floor, host and device peak memory, reads per step vs the cost model;
#   layer_eager, model_eager, model_graph: decode_cost.py --device cuda, bf16: layer mode (eager), then model mode
#      eager and graph-captured (RCRConfig.compile="reduce-overhead": the whole decode step replayed as a CUDA graph);
#   sync_offload: no host sync in an eager decode step of every registered method, under
#      torch.cuda.set_sync_debug_mode("error"); offload mode's CUDA path (pinned host store, side-stream copies)
#      token-identical to resident mode;
#   graphs: every registered method compiled with "reduce-overhead": whether its step was captured as a CUDA graph
#      (no cudagraph skip, a recorded graph; else the skip's reason), how many inputs each replay copies (0: every
#      input is a static address), no host sync in replayed steps, compiled vs eager tokens;
#   job: a 4-sample detailcaps job with --device cuda.
# It ends with one table: step, result, seconds, and the figures that matter.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
ROWS="$OUT/rows.tsv"
: > "$ROWS"

STEPS=" $* "

run() {  # run NAME LIMIT_S CMD...: log to $OUT/NAME.log, one row per step (only the named steps, if any are)
    local name=$1 limit=$2
    shift 2
    [ "$STEPS" != "  " ] && [[ "$STEPS" != *" $name "* ]] && return 0
    local t0=$SECONDS rc
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    local result=PASS
    [ $rc -eq 124 ] && result="TIMEOUT(${limit}s)"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && result="FAIL(rc=$rc)"
    grep -q "^CHECK .* FAIL" "$OUT/$name.log" && result=FAIL
    printf '%s\t%s\t%s\n' "$name" "$result" "$((SECONDS - t0))" >> "$ROWS"
}

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
    || { echo "gpu_check: no CUDA device"; exit 2; }

run real_size 300 python -m benchmarks.real_size --device cuda --root "$OUT/real_size"
run layer_eager 60 python benchmarks/decode_cost.py --device cuda --lengths 1024 16384 --settle 60 --steps 60
run model_eager 70 python benchmarks/decode_cost.py --device cuda --mode model --models embedded,7b \
    --lengths 1024 16384 --stack-layers 4 --tokens 32 --rounds 3 --settle 8
run model_graph 150 python benchmarks/decode_cost.py --device cuda --mode model --models embedded,7b \
    --methods full,rcr --lengths 16384 --stack-layers 4 --tokens 32 --rounds 3 --settle 8 --compile reduce-overhead

# the tiny left-padded batch of the two steps below (each script runs this file first)
cat > "$OUT/tiny_setup.py" <<'EOF'
import sys

import torch

sys.path.insert(0, "tests")
import rcr  # noqa: E402
import tiny_models  # noqa: E402
from rcr.methods import parse_method  # noqa: E402

dev = torch.device("cuda")
model, proc = tiny_models.qwen2_vl()
model = model.to(dev, torch.bfloat16)
inputs = tiny_models.batch_inputs(proc, [4, 20], image_size=224)  # left padded
cfg = rcr.RCRConfig(selected=8, window=8, candidates=32, page_size=4)
prefix = rcr.prefill(model, inputs, cfg)
N = 12
full = rcr.decode(model, prefix, parse_method("full", cfg), N, eos_token_id=[])
reference = rcr.answer_attention_scores(model, prefix, full)  # what prefill_oracle selects by


def check(name, ok, detail=""):
    print(f"CHECK {name} {'PASS' if ok else 'FAIL'} {detail}", flush=True)


def steps_without_sync(dec, warm=3):
    """Steps `warm` times (compile; CUDA graphs: warm-up and record), then to the end with any host sync an error;
    returns the error's first line, or ''."""
    with dec.enabled(), torch.no_grad():
        for _ in range(warm):
            dec.step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            while dec.t < N - 1:
                dec.step()
        except RuntimeError as e:
            return str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return ""
EOF
export OUT

run sync_offload 90 python - <<'EOF'
"""No host sync in an eager decode step of any registered method; offload == resident tokens."""
import os

exec(open(os.path.join(os.environ["OUT"], "tiny_setup.py")).read())

for label in sorted(rcr.METHODS):
    dec = rcr.Decoder(model, prefix, parse_method(label, cfg), N, eos_token_id=[], reference_scores=reference)
    err = steps_without_sync(dec)
    check(f"no_sync[{label},eager]", not err, err)

for label in ("rcr", "fixed", "rcr_layer"):
    res = rcr.decode(model, prefix, parse_method(label, cfg), 24, eos_token_id=[])
    off = rcr.decode(model, prefix, parse_method(label, cfg.replace(offload=True)), 24, eos_token_id=[])
    pinned = prefix.to_host().layers[0].keys.is_pinned()
    moved = off.telemetry.bytes_moved.sum()
    check(f"offload[{label}]", off.offload and pinned and torch.equal(res.sequences, off.sequences) and moved > 0,
          f"pinned={pinned} tokens_equal={torch.equal(res.sequences, off.sequences)} bytes_moved={moved:.0f} "
          f"refresh={res.telemetry.trigger.mean():.2f}")
EOF

run graphs 330 python - <<'EOF'
"""Every registered method under compile="reduce-overhead": its step captured as a CUDA graph or not (and why), the
inputs each replay copies, no host sync in replays, compiled vs eager tokens. One method per line, printed as it
finishes (each compiles, ~20-30 s)."""
import logging
import os

exec(open(os.path.join(os.environ["OUT"], "tiny_setup.py")).read())
from torch._dynamo.utils import counters  # noqa: E402

# inductor says why it skips a CUDA graph ("skipping cudagraphs due to ...") on its "cudagraphs" log artifact
torch._logging.set_logs(cudagraphs=True)
reasons = []


class Reasons(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if "skipping cudagraphs" in msg:
            reasons.append(msg.splitlines()[0])


logging.getLogger("torch._inductor").addHandler(Reasons())
for label in sorted(rcr.METHODS):
    torch._dynamo.reset()
    counters.clear()
    reasons.clear()
    dec = rcr.Decoder(model, prefix, parse_method(label, cfg.replace(compile="reduce-overhead")), N, eos_token_id=[],
                      reference_scores=reference)
    err = steps_without_sync(dec)
    inductor = counters["inductor"]
    # a recorded graph counts its inputs that are not static (copied into the graph's own buffers on each replay)
    captured = inductor["cudagraph_skips"] == 0 and "cudagraph_recorded_non_static_inputs" in inductor
    copied = inductor["cudagraph_recorded_non_static_inputs"]
    check(f"cuda_graph[{label}]", captured and copied == 0,
          f"captured={captured} inputs_copied_per_replay={copied} {'; '.join(reasons)[:300]}")
    check(f"no_sync[{label},reduce-overhead]", not err, err)
    if not err:
        eager = rcr.decode(model, prefix, parse_method(label, cfg), N, eos_token_id=[], reference_scores=reference)
        same = (dec.tokens.cpu() == eager.sequences).float().mean().item()
        # informational: compiled kernels may round differently in bf16
        print(f"CHECK compiled_vs_eager[{label}] {'PASS' if same == 1.0 else 'INFO'} tokens equal {same:.3f}",
              flush=True)
EOF

run job 100 python jobs/detailcaps.py --limit 4 --device cuda --dtype bfloat16 --num-actors 1 --gpus-per-actor 1 \
    --methods full,bacon,exact,rcr,quest --max-new-tokens 128 --output-dir "$OUT/job" \
    --mlflow-uri "sqlite:///$OUT/mlflow.db"

echo
echo "================================ gpu_check: $(python -c 'import torch; print(torch.cuda.get_device_name(0))')"
printf '%-14s %-16s %5s  %s\n' step result sec figures
while IFS=$'\t' read -r name result secs; do
    case $name in
        real_size) figs=$(grep -E "^table row" "$OUT/$name.log" | cut -c12- | tr '\n' ';' | cut -c1-600) ;;
        layer_eager) figs=$(grep -E "^ +[0-9]+ +(full|bacon|rcr|full\(gqa\)) " "$OUT/$name.log" \
                            | awk '{printf "%s %s %sms x%s; ", $1, $2, $3, $4}') ;;
        model_*) figs=$(grep -E "^(embedded|7B)" "$OUT/$name.log" | awk '{printf "%s %s %s tok/s x%s; ", $1$2$3$4, $(NF-2), $(NF-1), $NF}') ;;
        sync_offload) figs="$(grep -c '^CHECK .* PASS' "$OUT/$name.log") pass, $(grep -c '^CHECK .* FAIL' "$OUT/$name.log") fail, $(grep -c '^CHECK .* INFO' "$OUT/$name.log") info: $(grep -E '^CHECK .* (FAIL|INFO)' "$OUT/$name.log" | cut -c7- | tr '\n' ';')" ;;
        graphs) figs="graph captured: $(grep -E '^CHECK cuda_graph' "$OUT/$name.log" | sed -E 's/^CHECK cuda_graph\[([^]]*)\] [A-Z]+ captured=([A-Za-z]+) inputs_copied_per_replay=([0-9]+).*/\1 \2 (copies \3)/' | tr '\n' ';') $(grep -c '^CHECK .* FAIL' "$OUT/$name.log") fail, $(grep -c '^CHECK .* INFO' "$OUT/$name.log") info" ;;
        job) figs=$(tail -n 12 "$OUT/$name.log" | tr -s ' ' | tr '\n' '|' | cut -c1-400) ;;
    esac
    printf '%-14s %-16s %5s  %s\n' "$name" "$result" "$secs" "$figs"
done < "$ROWS"
echo "logs: $OUT"
