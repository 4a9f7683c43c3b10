#!/usr/bin/env bash
# What each GPU node needs under the cert-manager component: its client Certificate
# (DNS SAN = the node name) and its Secret projected into the shipper's TLS volume at
# <node>/. Writes two files into the current directory (an overlay's):
#   node-certificates.yaml   one Certificate per node      (list under `resources`)
#   node-tls-sources.yaml    the shipper's projected volume (list under `patches`)
# Usage, from the overlay's directory: ../../node-certificates.sh gpu-node-0 gpu-node-1
set -euo pipefail
(($#)) || { echo "usage: $0 NODE..." >&2; exit 2; }
for n in "$@"; do
    [[ $n =~ ^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$ ]] || { echo "not a Kubernetes node name: $n" >&2; exit 2; }
done
{
    echo "# Written by deploy/kubernetes/node-certificates.sh $*"
    for n in "$@"; do
        cat <<YAML
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: ringwatch-node-$n
spec:
  secretName: ringwatch-node-$n
  duration: 720h
  renewBefore: 240h
  privateKey:
    algorithm: ECDSA
    size: 256
    rotationPolicy: Always
  usages:
    - client auth
    - digital signature
  dnsNames:
    - $n
  issuerRef:
    name: ringwatch-ca
    kind: Issuer
    group: cert-manager.io
YAML
    done
} > node-certificates.yaml
{
    echo "# Written by deploy/kubernetes/node-certificates.sh $*"
    cat <<YAML
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: node-shipper
spec:
  template:
    spec:
      volumes:
        - name: node-tls
          projected:
            sources:
YAML
    for n in "$@"; do
        cat <<YAML
              - secret:
                  name: ringwatch-node-$n
                  items:
                    - {key: ca.crt, path: $n/ca.crt}
                    - {key: tls.crt, path: $n/tls.crt}
                    - {key: tls.key, path: $n/tls.key}
YAML
    done
} > node-tls-sources.yaml
echo "wrote node-certificates.yaml and node-tls-sources.yaml for $# node(s)"
