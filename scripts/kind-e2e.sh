#!/usr/bin/env bash
# `make kind-e2e`: the e2e suites (tests/e2e) on a real kind cluster (kubelet and
# containerd in Docker containers, kube-router enforcing NetworkPolicy) instead of the
# devcluster, everything built here with no registry reachable:
#
#   1. a Docker engine (images/engine.sh: the one answering, or ours);
#   2. our two images (images/build.sh) and, for the jobs' etcd, etcd 3.6 from the
#      binary make setup built, under the operator's default image name; Kueue's manager
#      from the binary make setup built (devcluster/build-kueue.sh), installed with its
#      own chart once the cluster is up;
#   3. the kind node image (images/kind/node-image.sh; cached under its inputs' hash);
#   4. a 3-node cluster (kind create cluster --image), our images loaded into its workers;
#   5. pytest tests/e2e with ELASTICJOB_E2E_KUBECONFIG; each suite helm-installs the chart
#      with our operator image (ELASTICJOB_E2E_HELM_ARGS), as it does on the devcluster.
#
# At the end it deletes the cluster by its name, the Docker network if it made it, and
# our Docker engine if it started one (KEEP_CLUSTER=1 keeps all three; then
# `scripts/kind-e2e.sh down` removes them). Arguments go to pytest.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
cache="${ELASTICJOB_CACHE:-$HOME/.cache/elasticjob}"
cluster="${KIND_CLUSTER:-elasticjob-e2e}"
# Our own Docker network, fenced: the nodes reach each other and this machine, and
# nothing beyond it (a Service VIP asked before kube-proxy serves it would otherwise
# leave through the host's default route). Docker's --internal would fence it too, but
# then publishes no port, and kind reaches the API server through one.
network=elasticjob-kind
bridge=ej-kind0
fence=(DOCKER-USER -i "$bridge" ! -o "$bridge" -j DROP)
tag="${IMAGE_TAG:-e2e}"
state="$cache/kind/$cluster"                  # what this script started, for `down`
shared="$state/shared"                         # both workers mount it at $shared_node
shared_node=/var/lib/elasticjob-e2e-shared
operator_image="elasticjob-operator:$tag"
runtime_image="elasticjob-runtime:$tag"
etcd_image="$(awk -F'"' '/^DEFAULT_ETCD_IMAGE/ {print $2}' "$repo/operator/elasticjob_operator/models.py")"
say() { echo "[kind-e2e $(date +%T)] $*" >&2; }

kind_bin() { echo "$("$repo/images/kind/build-binaries.sh")/kind"; }

down() {
  [[ -d "$state" ]] || return 0
  export DOCKER_HOST="$(cat "$state/docker-host")"
  if [[ -f "$state/cluster" ]]; then
    say "deleting kind cluster $cluster"
    "$(kind_bin)" delete cluster --name "$cluster" >&2 || true
  fi
  if [[ -f "$state/network" ]]; then docker network rm "$network" >/dev/null 2>&1 || true; fi
  if [[ -f "$state/fence" ]]; then iptables -D "${fence[@]}" 2>/dev/null || true; fi
  if [[ -f "$state/engine" ]]; then "$repo/images/engine.sh" down; fi
  rm -rf "$state"
}

if [[ "${1:-}" == down ]]; then down; exit 0; fi

# A cluster left by an earlier KEEP_CLUSTER=1 run is reused as it is.
mkdir -p "$state"
engine_was_running=0
[[ -f "$cache/docker/dockerd.pid" ]] && kill -0 "$(cat "$cache/docker/dockerd.pid")" 2>/dev/null && engine_was_running=1
DOCKER_HOST="$("$repo/images/engine.sh" up)"
export DOCKER_HOST
echo "$DOCKER_HOST" >"$state/docker-host"
if [[ "$DOCKER_HOST" == "unix://$cache/docker/docker.sock" && "$engine_was_running" == 0 ]]; then
  touch "$state/engine"
fi
if [[ "${KEEP_CLUSTER:-0}" != 1 ]]; then trap down EXIT; fi

started=$(date +%s)
IMAGE_TAG="$tag" "$repo/images/build.sh" >/dev/null
if ! docker image inspect "$etcd_image" >/dev/null 2>&1; then
  say "image $etcd_image: etcd $(basename "$etcd_image" | cut -d: -f2) built by make setup"
  etcd_bin="$("$repo/devcluster/build-binaries.sh")/etcd"
  ctx="$(mktemp -d)"
  cp "$etcd_bin" "$ctx/etcd"
  printf 'FROM scratch\nCOPY etcd /usr/local/bin/etcd\nENV PATH=/usr/local/bin\nUSER 65532:65532\nENTRYPOINT ["etcd"]\n' |
    "$("$repo/images/engine.sh" builder)" build --quiet -t "$etcd_image" -f - "$ctx" >/dev/null
  rm -rf "$ctx"
fi
kueue_dir="$("$repo/devcluster/build-kueue.sh")"
kueue_version="$(basename "$kueue_dir" | sed 's/^kueue-//')"
kueue_image="kueue:$kueue_version"
if ! docker image inspect "$kueue_image" >/dev/null 2>&1; then
  say "image $kueue_image: the Kueue manager built by make setup"
  ctx="$(mktemp -d)"
  cp "$kueue_dir/kueue" "$ctx/manager"
  printf 'FROM scratch\nCOPY manager /manager\nUSER 65532:65532\nENTRYPOINT ["/manager"]\n' |
    "$("$repo/images/engine.sh" builder)" build --quiet -t "$kueue_image" -f - "$ctx" >/dev/null
  rm -rf "$ctx"
fi
node_image="$("$repo/images/kind/node-image.sh")"
kind="$(kind_bin)"
say "images ready in $(($(date +%s) - started)) s; node image $node_image"

export KIND_EXPERIMENTAL_DOCKER_NETWORK="$network"
if ! "$kind" get clusters 2>/dev/null | grep -qx "$cluster"; then
  if ! docker network inspect "$network" >/dev/null 2>&1; then
    docker network create --driver bridge -o "com.docker.network.bridge.name=$bridge" "$network" >/dev/null
    touch "$state/network"
  fi
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    say "the Docker network $network has no bridge $bridge on this machine to fence: remove it (docker network rm $network)"
    exit 1
  fi
  iptables -C "${fence[@]}" 2>/dev/null || iptables -I "${fence[@]}"
  touch "$state/fence"
  # one directory of this machine in both workers: the tests' ReadWriteMany volumes
  # (a host-path volume is otherwise one node's alone); sticky and open to the pods' uids
  mkdir -p "$shared"
  chmod 1777 "$shared"
  config="$state/cluster.yaml"
  tags="$(docker run --rm --entrypoint cat "$node_image" /kind/image-tags)"
  cat >"$config" <<EOF
# three nodes: the control plane and two workers, as a small real cluster
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
  - role: worker
    extraMounts: [{hostPath: "$shared", containerPath: "$shared_node"}]
  - role: worker
    extraMounts: [{hostPath: "$shared", containerPath: "$shared_node"}]
# kube-scheduler's gang placement (alpha in 1.35): the Workload API and the plugin that
# binds a gang's minCount pods together or none (tests/e2e/test_kube_scheduler.py)
featureGates:
  GenericWorkload: true
  GangScheduling: true
runtimeConfig:
  "scheduling.k8s.io/v1alpha1": "true"
kubeadmConfigPatches:
  # the hosts here have cgroup v1, which kubelet 1.35 refuses unless told
  - |
    kind: KubeletConfiguration
    failCgroupV1: false
  # the etcd and CoreDNS the node image carries, not kubeadm's defaults
  - |
    kind: ClusterConfiguration
    etcd:
      local:
        imageTag: "$(echo "$tags" | awk -F= '$1=="etcd" {print $2}')"
    dns:
      imageTag: "$(echo "$tags" | awk -F= '$1=="coredns" {print $2}')"
EOF
  say "kind create cluster $cluster (3 nodes)"
  touch "$state/cluster"
  t=$(date +%s)
  "$kind" create cluster --name "$cluster" --image "$node_image" --config "$config" \
    --kubeconfig "$state/kubeconfig" --wait 300s >&2
  say "cluster ready in $(($(date +%s) - t)) s"
fi

# Our images go to the workers only (the control plane takes no pods), each unpacked and
# its layer blobs dropped: `kind load` keeps both, 10 GB per node for the runtime image.
# Every run, so a kept cluster gets rebuilt images; a node that has the same image skips it.
t=$(date +%s)
for node in $(docker ps --filter "label=io.x-k8s.kind.cluster=$cluster" \
    --filter label=io.x-k8s.kind.role=worker --format '{{.Names}}'); do
  for image in "$operator_image" "$runtime_image" "$etcd_image" "$kueue_image"; do
    want="$(docker image inspect -f '{{.Id}}' "$image")"
    has="$(docker exec "$node" crictl inspecti -o go-template --template '{{.status.id}}' "$image" 2>/dev/null || true)"
    [[ "$has" == "$want" ]] && continue
    say "loading $image into $node"
    docker save "$image" | docker exec -i "$node" ctr --namespace=k8s.io images import \
      --digests --discard-unpacked-layers --snapshotter=overlayfs - >/dev/null
  done
done
say "images on the workers in $(($(date +%s) - t)) s"

# Kueue from its own chart (the pinned release's), with the image built above; its
# webhooks and certificates are the chart's (internal certificate management).
if ! helm --kubeconfig "$state/kubeconfig" status kueue -n kueue-system >/dev/null 2>&1; then
  say "helm install kueue $kueue_version"
  helm --kubeconfig "$state/kubeconfig" install kueue "$kueue_dir/chart" \
    --namespace kueue-system --create-namespace \
    --set controllerManager.manager.image.repository=kueue \
    --set "controllerManager.manager.image.tag=$kueue_version" \
    --set controllerManager.manager.image.pullPolicy=Never \
    --wait --timeout 300s >&2
fi

export ELASTICJOB_E2E_KUBECONFIG="$state/kubeconfig"
export ELASTICJOB_E2E_KIND_CLUSTER="$cluster"
export ELASTICJOB_E2E_RUNTIME_IMAGE="$runtime_image"
export ELASTICJOB_E2E_SHARED_DIR="$shared" ELASTICJOB_E2E_SHARED_NODE_DIR="$shared_node"
export ELASTICJOB_E2E_NETWORK_POLICY_ENFORCED=1   # kube-router
export ELASTICJOB_E2E_HELM_ARGS="--set image.repository=elasticjob-operator --set image.tag=$tag --set image.pullPolicy=Never"
cd "$repo"
"$repo/scripts/pytest-strict" tests/e2e -m e2e "$@"
