#!/bin/sh
# The whole suite, as `make test` and CI run it, in three lanes side by side. Most integration tests wait
# (for engines to start, for Prometheus windows to fill, for alerts to travel), so the lanes overlap their
# waits. The vLLM lane: the real-vLLM tests, pinned to the last core (their engines with it), then the
# lab fault tests. The alert lane: the alert and rule tests, which mostly wait for Prometheus, then the
# real-sessions browser test and the lab experiment. The rest runs in the foreground; the two other
# lanes' reports follow its own. On a single core the lanes run one after the other. Fails if any part
# failed.
#   usage: sh scripts/test.sh PYTHON
set -u

python=$1
vllm_tests="tests/test_vllm_contract.py tests/test_vllm_lab.py"
after_vllm="tests/test_lab_faults.py"
alert_tests="tests/test_alerts_lab.py tests/test_rules_lab.py tests/test_router_prediction.py"
after_alerts="tests/test_dashboard_gateway_browser.py tests/test_lab_experiment.py"
pin=""

# part NAME [COMMAND PREFIX...] -- TEST FILES...: one pytest, in a temporary directory of its own
# (pytest empties its --basetemp).
part() {
    name=$1
    shift
    prefix=""
    while [ "$1" != "--" ]; do
        prefix="$prefix $1"
        shift
    done
    shift
    # shellcheck disable=SC2086
    $prefix "$python" -m pytest -q -p no:cacheprovider --durations=10 \
        --basetemp="${TMPDIR:-/tmp}/kvwatch-tests-$name" "$@"
}
# shellcheck disable=SC2086
vllm_lane() {
    part vllm $pin -- $vllm_tests
    first=$?
    part faults -- $after_vllm && [ "$first" -eq 0 ]
}
# shellcheck disable=SC2086
alert_lane() {
    part alerts -- $alert_tests
    first=$?
    part browser -- $after_alerts && [ "$first" -eq 0 ]
}
rest() {
    # shellcheck disable=SC2046
    "$python" -m pytest -q -p no:cacheprovider --durations=15 \
        $(printf -- '--ignore=%s ' $vllm_tests $after_vllm $alert_tests $after_alerts)
}

if [ "$(nproc)" -ge 2 ]; then
    mkdir -p test-artifacts
    echo "The real-vLLM and lab fault tests (vLLM on core $(($(nproc) - 1))), and the alert, rule and" \
        "lab experiment tests, run beside the rest; their reports follow the rest's."
    pin="taskset -c $(($(nproc) - 1))"
    vllm_lane >test-artifacts/vllm-lane.log 2>&1 &
    vllm_pid=$!
    alert_lane >test-artifacts/alert-lane.log 2>&1 &
    alert_pid=$!
    rest
    rest_status=$?
    wait "$vllm_pid"
    vllm_status=$?
    wait "$alert_pid"
    alert_status=$?
    for lane in vllm-lane alert-lane; do
        echo
        echo "=== test-artifacts/$lane.log ==="
        cat "test-artifacts/$lane.log"
    done
else
    rest
    rest_status=$?
    vllm_lane
    vllm_status=$?
    alert_lane
    alert_status=$?
fi
[ "$rest_status" -eq 0 ] && [ "$vllm_status" -eq 0 ] && [ "$alert_status" -eq 0 ]
