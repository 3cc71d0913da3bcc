#!/bin/sh
# The whole suite, as `make test` and CI run it, in two lanes side by side. The real-vLLM tests mostly
# wait for engines to start, restart and be scraped: they run in a pytest of their own pinned to the last
# core (their engines with it), then the alert and rule tests, which mostly wait for Prometheus, and the
# Envoy, multi-cluster and SageMaker labs', on every core; the rest runs beside them. On a single core the lanes
# run one after the other. Fails if any part failed.
#   usage: sh scripts/test.sh PYTHON
set -u

python=$1
vllm_tests="tests/integration/test_vllm_contract.py tests/integration/test_vllm_lab.py
    tests/integration/test_sagemaker_contract.py tests/integration/test_sagemaker_vllm.py
    tests/integration/test_sagemaker_vllm_reuse.py
    tests/integration/test_vllm_first_byte.py"
after_vllm="tests/integration/test_alerts_lab.py tests/integration/test_rules_lab.py
    tests/integration/test_router_prediction.py tests/integration/test_lab_envoy.py
    tests/integration/test_lab_envoy_maglev.py tests/integration/test_lab_clusters.py
    tests/integration/test_sagemaker_probe.py tests/integration/test_lab_sagemaker.py
    tests/integration/test_probe_share_lab.py"
log=test-artifacts/beside.log
last_core=$(($(nproc) - 1))
pin=""

run_pytest() {
    "$python" -m pytest -q -p no:cacheprovider "$@"
}
# shellcheck disable=SC2086
beside() {
    $pin "$python" -m pytest -q -p no:cacheprovider --durations=10 --basetemp="${TMPDIR:-/tmp}/kvwatch-vllm-tests" $vllm_tests
    vllm=$?
    run_pytest --durations=10 --basetemp="${TMPDIR:-/tmp}/kvwatch-alert-tests" $after_vllm
    alerts=$?
    [ "$vllm" -eq 0 ] && [ "$alerts" -eq 0 ]
}
rest() {
    # shellcheck disable=SC2046
    run_pytest --durations=15 $(printf -- '--ignore=%s ' $vllm_tests $after_vllm)
}

if [ "$last_core" -ge 1 ]; then
    mkdir -p test-artifacts
    echo "The real-vLLM tests (on core $last_core), then the alert tests, run beside the rest;" \
        "their report follows the rest's."
    pin="taskset -c $last_core"
    beside >"$log" 2>&1 &
    beside_pid=$!
    rest
    rest_status=$?
    wait "$beside_pid"
    beside_status=$?
    echo
    echo "=== the real-vLLM and alert tests ($log) ==="
    cat "$log"
else
    rest
    rest_status=$?
    beside
    beside_status=$?
fi
[ "$rest_status" -eq 0 ] && [ "$beside_status" -eq 0 ]
