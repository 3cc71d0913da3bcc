#!/bin/sh
# The whole suite, as `make test` and CI run it, in two lanes side by side. The real-vLLM tests mostly
# wait for engines to start, restart and be scraped: they run in a pytest of their own pinned to the last
# core (their engines with it). The rest runs beside them in pytest-xdist workers, one test module at a
# time per worker (a module's lab is its own): one worker more than there are cores, because much of a
# module's time is spent waiting for rule windows, alerts and restarts while the cores have room.
# On a single core the lanes run one after the other. Fails if any part failed.
#   usage: sh scripts/test.sh PYTHON
set -u

python=$1
vllm_tests="tests/integration/test_vllm_contract.py tests/integration/test_vllm_lab.py
    tests/integration/test_sagemaker_contract.py tests/integration/test_sagemaker_vllm.py
    tests/integration/test_sagemaker_vllm_reuse.py
    tests/integration/test_vllm_first_byte.py"
log=test-artifacts/vllm.log
last_core=$(($(nproc) - 1))
workers=$((last_core + 2))

run_pytest() {
    "$python" -m pytest -q -p no:cacheprovider "$@"
}
# shellcheck disable=SC2086
vllm() {
    $pin "$python" -m pytest -q -p no:cacheprovider --durations=10 --basetemp="${TMPDIR:-/tmp}/kvwatch-vllm-tests" $vllm_tests
}
rest() {
    # shellcheck disable=SC2046
    # --no-loadscope-reorder: the modules in the order tests/conftest.py collects them, longest first
    # (pytest-xdist's own order, most tests first, starts a long module of one test last).
    run_pytest --durations=25 -n "$workers" --dist loadfile --no-loadscope-reorder \
        --basetemp="${TMPDIR:-/tmp}/kvwatch-tests" \
        $(printf -- '--ignore=%s ' $vllm_tests)
}

if [ "$last_core" -ge 1 ]; then
    mkdir -p test-artifacts
    echo "The real-vLLM tests run on core $last_core beside the rest; their report follows the rest's."
    pin="taskset -c $last_core"
    vllm >"$log" 2>&1 &
    vllm_pid=$!
    rest
    rest_status=$?
    wait "$vllm_pid"
    vllm_status=$?
    echo
    echo "=== the real-vLLM tests ($log) ==="
    cat "$log"
else
    pin=""
    rest
    rest_status=$?
    vllm
    vllm_status=$?
fi
[ "$rest_status" -eq 0 ] && [ "$vllm_status" -eq 0 ]
