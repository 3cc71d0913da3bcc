#!/bin/sh
# The whole suite, as `make test` and CI run it. The real-vLLM tests mostly wait for engines to start,
# restart and be scraped, so they run beside the rest, in a pytest of their own pinned to the last core
# (their engines with it); on a single core they run after the rest. Fails if either part failed.
#   usage: sh scripts/test.sh PYTHON
set -u

python=$1
vllm_tests="tests/test_vllm_contract.py tests/test_vllm_lab.py"
log=test-artifacts/vllm-tests.log
last_core=$(($(nproc) - 1))

# shellcheck disable=SC2086
run_vllm() {
    $pin "$python" -m pytest -q -p no:cacheprovider --basetemp="${TMPDIR:-/tmp}/kvwatch-vllm-tests" $vllm_tests
}
run_rest() {
    # shellcheck disable=SC2046
    "$python" -m pytest -q --durations=15 -p no:cacheprovider $(printf -- '--ignore=%s ' $vllm_tests)
}

pin=""
if [ "$last_core" -ge 1 ]; then
    mkdir -p test-artifacts
    echo "The real-vLLM tests run beside the rest, on core $last_core; their report follows the rest's."
    pin="taskset -c $last_core"  # pytest and all it starts, engines included
    run_vllm >"$log" 2>&1 &
    vllm_pid=$!
    run_rest
    rest=$?
    wait "$vllm_pid"
    vllm=$?
    echo
    echo "=== the real-vLLM tests ($log) ==="
    cat "$log"
else
    run_rest
    rest=$?
    run_vllm
    vllm=$?
fi
[ "$rest" -eq 0 ] && [ "$vllm" -eq 0 ]
