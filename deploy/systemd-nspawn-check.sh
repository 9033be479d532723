#!/usr/bin/env bash
# Run deploy/systemd's units under a real systemd: a Debian bookworm tree (debootstrap) booted with
# systemd-nspawn, the units installed as docs/operations/systemd.md says, meshrl.target started, a short run on the
# CPU, a kill -9 of the rollout and of the trainer (systemd restarts each; the run goes on), the target stopped.
#
#   sudo MESHRL_VENV=/path/to/venv deploy/systemd-nspawn-check.sh
#
# Needs root, the Debian packages debootstrap and systemd-container, and a venv with meshrl installed editable
# from this checkout (default: ./.venv) on a bookworm host: the venv, the Python it was made from and this checkout
# are bind-mounted read-only into the container (venv at /opt/meshrl/venv, checkout at the path the venv's
# editable install points at), so nothing is pip-installed there. The container has its own network (loopback
# only), so the services' fixed ports (7070-7073, 9070-9073) do not meet the host's. It runs without systemd on
# the host (no machined: --register=no --keep-unit), so `machinectl list` does not show it.
#
# The tree is built once into $MESHRL_NSPAWN_CACHE (default /var/cache/meshrl-nspawn/bookworm); each check boots a
# copy of it, which is removed at the end with the machine powered off and the cgroups nspawn made removed,
# whatever the outcome. Logs (console, the units' journal, coordctl's output) go to the cache's logs/<time>/.
# Not run in CI: it needs root and a tree of 260 MB, and takes 1.5 minutes on an idle 2-core machine, 3 to 8 on a
# busy one (plus about a minute for debootstrap the first time).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${MESHRL_VENV:-$REPO/.venv}
CACHE=${MESHRL_NSPAWN_CACHE:-/var/cache/meshrl-nspawn}
BASE=$CACHE/bookworm
RUN_TREE=$CACHE/run-$$
LOGS=$CACHE/logs/$(date -u +%Y%m%dT%H%M%SZ)
MACHINE=meshrl-check
MIRROR=${MESHRL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
STEPS=40        # the run's steps: long enough that both kills land mid-run
SAVE_FREQ=10    # a checkpoint every 10 steps, which the restarted trainer continues from
WAIT_S=600      # the most any one wait below takes (a loaded machine is slow, never this slow)
# The host's libraries that the venv's Python and torch load, beyond Debian's minimal base.
PACKAGES=systemd,systemd-sysv,dbus,procps,iproute2,libffi8,libsqlite3-0,libssl3,libexpat1,libreadline8,libncursesw6
PACKAGES+=,libbz2-1.0,liblzma5,zlib1g,libtirpc3,libgomp1,libgssapi-krb5-2

STARTED=$(date +%s)
NSPAWN_PID=
LEADER=    # the container's systemd (its PID 1), as the host sees it: what nsenter enters
CHECKOUT=  # where the venv's editable install imports meshrl from: this checkout is bound there
say() { echo "[$(($(date +%s) - STARTED)) s] $*"; }
fail() { say "FAILED: $*"; exit 1; }

venv_python_prefix() {
    # pyvenv.cfg's "home = PREFIX/bin": the Python the venv was made from, which the container needs at that path.
    sed -n 's/^home = \(.*\)\/bin$/\1/p' "$VENV/pyvenv.cfg"
}

editable_checkout() {
    # The folder the venv's editable install of meshrl imports `services` from.
    grep -ho "'services': '[^']*'" "$VENV"/lib/python3*/site-packages/__editable___meshrl_*_finder.py \
        | sed "s/'services': '\(.*\)\/services'/\1/"
}

build_base_tree() {
    [[ -d $BASE ]] && return
    say "building $BASE (debootstrap bookworm, minbase)"
    rm -rf "$BASE.partial"
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$BASE.partial" "$MIRROR" > "$LOGS/debootstrap.txt"
    systemctl --root="$BASE.partial" mask console-getty.service   # nobody logs in: the console is only logged
    mv "$BASE.partial" "$BASE"
}

prepare_run_tree() {
    cp -a "$BASE" "$RUN_TREE"
    echo "$MACHINE" > "$RUN_TREE/etc/hostname"
    # One node: the coordinator's name in the config files (coord-host) is this machine.
    printf '127.0.0.1 localhost %s coord-host\n::1 localhost\n' "$MACHINE" > "$RUN_TREE/etc/hosts"
    # The meshrl user reaches the venv's Python through /root when it lives there (pyenv).
    chmod 0711 "$RUN_TREE/root"
    # pip would write this script into the venv; the bound venv's own names the host's venv path.
    printf '#!/opt/meshrl/venv/bin/python\nfrom services.coordctl.cli import app\napp()\n' \
        > "$RUN_TREE/usr/local/bin/coordctl"
    chmod 0755 "$RUN_TREE/usr/local/bin/coordctl"
}

boot() {
    local prefix checkout
    prefix=$(venv_python_prefix)
    checkout=$(editable_checkout)
    [[ -n $prefix ]] || fail "$VENV/pyvenv.cfg names no home = PREFIX/bin: set MESHRL_VENV to a venv"
    [[ -n $checkout ]] || fail "$VENV has no editable install of meshrl (pip install -e .)"
    [[ $prefix != /usr ]] || fail "$VENV was made from /usr's Python: give a venv of a Python outside /usr"
    mkdir -p "$RUN_TREE$prefix" "$RUN_TREE$checkout" "$RUN_TREE/opt/meshrl/venv"
    systemd-nspawn --quiet --register=no --keep-unit --private-network --machine="$MACHINE" \
        --directory="$RUN_TREE" --console=read-only \
        --bind-ro="$VENV:/opt/meshrl/venv" --bind-ro="$prefix" --bind-ro="$REPO:$checkout" \
        --boot < /dev/null > "$LOGS/console.txt" 2>&1 &
    NSPAWN_PID=$!
    until LEADER=$(pgrep -P "$NSPAWN_PID" -x systemd); do
        kill -0 "$NSPAWN_PID" 2> /dev/null || fail "systemd-nspawn exited: see $LOGS/console.txt"
        sleep 0.5
    done
    CHECKOUT=$checkout
}

inside() {
    nsenter --target "$LEADER" --mount --uts --ipc --net --pid --cgroup --root --wd -- \
        /usr/bin/env -i PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"
}

coordctl() {
    # As the docs say: the units' environment file, then coordctl (the coordinator at coord-host:7070).
    inside bash -c 'set -a; . /etc/meshrl/meshrl.env; set +a; exec coordctl "$@" --coordinator coord-host:7070' \
        coordctl "$@"
}

unit_property() { inside systemctl show --property="$2" --value "$1"; }

wait_until() {
    # wait_until WHAT COMMAND...: run COMMAND every 2 s until it succeeds; fail after WAIT_S.
    local what=$1 deadline=$(($(date +%s) + WAIT_S))
    shift
    until "$@"; do
        (($(date +%s) < deadline)) || fail "waited ${WAIT_S} s for $what"
        sleep 2
    done
}

system_is_up() { [[ $(inside systemctl is-system-running --wait 2> /dev/null) =~ ^(running|degraded)$ ]]; }

install_as_documented() {
    # docs/operations/systemd.md, "On every node, as root, in a meshrl checkout" (the venv is bound, not installed);
    # then `coordctl init` for the run config, the tiny model, its data and the cluster token.
    inside bash -euc "cd $CHECKOUT
        useradd --system --home-dir /var/lib/meshrl --shell /usr/sbin/nologin meshrl
        install -d -m 0750 -g meshrl /etc/meshrl /etc/meshrl/tls
        install -m 0640 -g meshrl deploy/systemd/*.yaml deploy/systemd/meshrl.env /etc/meshrl/
        cp deploy/systemd/meshrl*.service deploy/systemd/meshrl.target /etc/systemd/system/ && systemctl daemon-reload
        coordctl init /srv/meshrl-demo --coordinator-host coord-host > /srv/coordctl-init.txt 2>&1
        chown -R meshrl:meshrl /srv/meshrl-demo
        install -m 0640 -g meshrl /srv/meshrl-demo/token /etc/meshrl/token
        # This node's choices: the CPU, and the hf engine (vLLM needs a GPU).
        sed -i -e 's/^engine: vllm .*/engine: hf/' -e 's/^device: cuda .*/device: cpu/' /etc/meshrl/rollout.yaml
        sed -i -e 's/^device: cuda .*/device: cpu/' /etc/meshrl/trainer.yaml
        grep -qx 'engine: hf' /etc/meshrl/rollout.yaml && grep -qx 'device: cpu' /etc/meshrl/rollout.yaml
        grep -qx 'device: cpu' /etc/meshrl/trainer.yaml"
}

UNITS=(meshrl-coordinator meshrl-reward meshrl-trainer meshrl-rollout)
WORKERS=(meshrl-reward meshrl-trainer meshrl-rollout)

services_up() {
    # The trainer, rollout and reward service each registered and heartbeating.
    local table
    table=$(coordctl services 2>&1) || return 1
    echo "$table" > "$LOGS/services.txt"
    for kind in trainer rollout reward; do
        grep -qE "^$MACHINE +$kind +default .* up " <<< "$table" || return 1
    done
}

check_start_order() {
    # Each worker began starting only once the coordinator was started (After=meshrl-coordinator.service).
    local coordinator_up
    coordinator_up=$(unit_property meshrl-coordinator ActiveEnterTimestampMonotonic)
    for unit in "${WORKERS[@]}"; do
        local began
        began=$(unit_property "$unit" InactiveExitTimestampMonotonic)
        ((began >= coordinator_up)) || fail "$unit began starting before the coordinator was started"
        say "  $unit began starting $(((began - coordinator_up) / 1000)) ms after the coordinator was started"
    done
}

all_stopped() {
    # `systemctl stop meshrl.target` returns once the target is down, which it is first: the services stop after.
    for unit in "${UNITS[@]}"; do
        [[ $(unit_property "$unit" ActiveState) =~ ^(inactive|failed)$ ]] || return 1
    done
}

check_stop_order() {
    # The coordinator began stopping only once every worker had stopped, and each stopped cleanly.
    local coordinator_stopping
    coordinator_stopping=$(unit_property meshrl-coordinator ActiveExitTimestampMonotonic)
    for unit in "${UNITS[@]}"; do
        [[ $(unit_property "$unit" ActiveState) == inactive ]] || fail "$unit is $(unit_property "$unit" ActiveState)"
        [[ $(unit_property "$unit" Result) == success ]] || fail "$unit stopped with $(unit_property "$unit" Result)"
        local stopping stopped
        stopping=$(unit_property "$unit" ActiveExitTimestampMonotonic)
        stopped=$(unit_property "$unit" InactiveEnterTimestampMonotonic)
        say "  $unit stopped in $(((stopped - stopping) / 1000)) ms"
        [[ $unit == meshrl-coordinator ]] || ((stopped <= coordinator_stopping)) \
            || fail "the coordinator began stopping before $unit had stopped"
    done
}

run_field() {
    # The run's state (field 2) or step (field 4, "N/M", as N) from `coordctl status RUN`'s first line.
    local line
    line=$(coordctl status "$RUN" | head -1)
    case $1 in
        state) awk '{print $2}' <<< "$line" ;;
        step) awk '{split($4, s, "/"); print s[1]}' <<< "$line" ;;
    esac
}

run_reached() {
    # run_reached STEP: true once the run is past STEP; fails the check when the run ended before.
    local state
    state=$(run_field state)
    [[ $state =~ ^(failed|stopped)$ ]] && fail "the run ended $state: $(coordctl status "$RUN" | sed -n 2p)"
    (($(run_field step) >= $1)) || [[ $state == finished ]]
}

run_finished() {
    # The run's last step is done and its state says so (it finishes a moment after its last step's metrics).
    run_reached "$STEPS" && [[ $(run_field state) == finished ]]
}

unit_restarted() {
    # unit_restarted UNIT OLD_PID RESTARTS: systemd started UNIT again, as a new process.
    local pid
    pid=$(unit_property "$1" MainPID)
    [[ $(unit_property "$1" ActiveState) == active && $pid != 0 && $pid != "$2" ]] \
        && (($(unit_property "$1" NRestarts) > $3))
}

kill_and_check_restart() {
    local unit=$1 pid restarts step
    pid=$(unit_property "$unit" MainPID)
    restarts=$(unit_property "$unit" NRestarts)
    step=$(run_field step)
    say "kill -9 $unit (pid $pid) at step $step"
    inside kill -9 "$pid"
    wait_until "systemd to restart $unit" unit_restarted "$unit" "$pid" "$restarts"
    say "  systemd restarted $unit (pid $(unit_property "$unit" MainPID))"
    wait_until "the run to go on past step $((step + 2))" run_reached $((step + 2))
    say "  the run went on: step $(run_field step)"
}

record_state() {
    [[ -n $LEADER ]] || return 0
    inside journalctl --no-pager -o short-monotonic -u 'meshrl*' > "$LOGS/journal.txt" 2>&1
    inside systemctl --no-pager status 'meshrl*' > "$LOGS/status.txt" 2>&1
}

cgroups_made_by_nspawn() {
    # nspawn --keep-unit puts the container in "payload" and itself in "supervisor" under its own cgroup (in each
    # systemd hierarchy: name=systemd and cgroup2), and leaves both behind.
    local legacy unified
    legacy=$(sed -n 's/^[0-9]*:name=systemd://p' /proc/self/cgroup)
    unified=$(sed -n 's/^0:://p' /proc/self/cgroup)
    [[ -d /sys/fs/cgroup/systemd ]] && echo "/sys/fs/cgroup/systemd${legacy%/}/payload /sys/fs/cgroup/systemd${legacy%/}/supervisor"
    local root=/sys/fs/cgroup
    [[ -d $root/unified ]] && root=$root/unified
    echo "$root${unified%/}/payload $root${unified%/}/supervisor"
}

cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM
    record_state
    if [[ -n $NSPAWN_PID ]] && kill -0 "$NSPAWN_PID" 2> /dev/null; then
        [[ -n $LEADER ]] && inside systemctl poweroff --no-block
        for _ in $(seq 60); do kill -0 "$NSPAWN_PID" 2> /dev/null || break; sleep 1; done
        kill -0 "$NSPAWN_PID" 2> /dev/null && { say "the machine did not power off in 60 s: SIGKILL"; kill -KILL "$NSPAWN_PID"; }
        wait "$NSPAWN_PID"
        say "machine powered off"
    fi
    for cgroup in $NEW_CGROUPS; do
        [[ -d $cgroup ]] && find "$cgroup" -depth -type d -exec rmdir {} \;
    done
    rm -rf "$RUN_TREE"
    rmdir "/run/systemd/nspawn/propagate/$MACHINE" 2> /dev/null
    mount | grep -F "$RUN_TREE" && { say "mounts of $RUN_TREE are left"; rc=1; }
    if ((rc == 0)); then say "PASSED (logs: $LOGS)"; else say "FAILED (logs: $LOGS)"; fi
    exit "$rc"
}

main() {
    [[ $(id -u) == 0 ]] || fail "run as root (systemd-nspawn and debootstrap need it)"
    for tool in debootstrap systemd-nspawn nsenter; do
        command -v "$tool" > /dev/null || fail "$tool is missing: apt-get install -y debootstrap systemd-container"
    done
    [[ -f $VENV/pyvenv.cfg ]] || fail "$VENV is not a venv: set MESHRL_VENV"
    mkdir -p "$LOGS"
    NEW_CGROUPS=$(for cgroup in $(cgroups_made_by_nspawn); do [[ -d $cgroup ]] || echo "$cgroup"; done)
    trap cleanup EXIT
    trap 'say "interrupted"; exit 130' INT TERM

    build_base_tree
    prepare_run_tree
    boot
    wait_until "the container's systemd to boot" system_is_up
    say "booted (systemd $(inside systemctl --version | awk 'NR==1{print $2}'), system running)"

    install_as_documented
    say "units installed as docs/operations/systemd.md says"
    inside systemctl enable --quiet "${UNITS[@]}"
    inside systemctl enable --quiet --now meshrl.target
    say "meshrl.target started"
    check_start_order
    wait_until "the trainer, rollout and reward service to register" services_up
    say "trainer, rollout and reward service registered with the coordinator"

    coordctl start-run /srv/meshrl-demo/run.yaml --detach "trainer.total_training_steps=$STEPS" \
        "trainer.save_freq=$SAVE_FREQ" > "$LOGS/start-run.txt"
    RUN=$(coordctl runs | awk 'NR==2{print $1}')
    say "run $RUN started ($STEPS steps)"
    wait_until "the run's step 3" run_reached 3
    kill_and_check_restart meshrl-rollout
    wait_until "the run's step $((SAVE_FREQ + 2))" run_reached $((SAVE_FREQ + 2))   # past its first checkpoint
    kill_and_check_restart meshrl-trainer
    wait_until "the run to finish" run_finished
    coordctl status "$RUN" > "$LOGS/status-run.txt"
    say "run finished: $(head -1 "$LOGS/status-run.txt")"

    local stopping
    stopping=$(date +%s)
    inside systemctl stop meshrl.target
    wait_until "the services to stop" all_stopped
    say "meshrl.target and its services stopped in $(($(date +%s) - stopping)) s"
    check_stop_order
}

main "$@"
