# A kind node: systemd runs containerd and the kubelet; kind execs kubeadm in it.
# Built by images/kind/node-image.sh, whose build context holds the programs, node/
# and preloaded.tar (the images kubeadm and the network run).
ARG ROOTFS
FROM ${ROOTFS}
COPY kubelet kubeadm kube-proxy /usr/bin/
COPY crictl /usr/local/bin/
COPY bridge host-local loopback portmap ptp /opt/cni/bin/
COPY preloaded.tar /kind/images/
COPY node/ /
# kind execs `kubectl --kubeconfig=/etc/kubernetes/admin.conf` to apply the CNI
COPY kubectl /usr/bin/
RUN mkdir -p /etc/kubernetes/manifests /etc/cni/net.d /var/lib/kubelet \
 && systemctl enable containerd.service kubelet.service elasticjob-preload-images.service
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]
