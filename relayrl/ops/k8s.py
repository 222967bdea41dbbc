"""Scaling rollout workers that run as a Kubernetes StatefulSet (``relayrl scale rollout N --k8s-namespace``).

A StatefulSet scales down from its highest ordinals, so the workers of pods ``NAME-N`` and above are
drained first (through the controller, when one is reachable), then the scale subresource is patched.
Needs the ``kubernetes`` package (``pip install relayrl[k8s]``) and RBAC for ``statefulsets/scale``
(get, patch). Exercised here only against a mocked ``AppsV1Api``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


def apps_api():
    """AppsV1Api from the in-cluster service account, else from ~/.kube/config (KUBECONFIG)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise RuntimeError("scaling a StatefulSet needs the kubernetes package: pip install 'relayrl[k8s]'") from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.AppsV1Api()


def scale_statefulset(namespace: str, name: str, replicas: int, api=None) -> int:
    """Set ``spec.replicas`` through the scale subresource; returns the previous count."""
    api = api or apps_api()
    previous = api.read_namespaced_stateful_set_scale(name, namespace).spec.replicas
    api.patch_namespaced_stateful_set_scale(name, namespace, {"spec": {"replicas": replicas}})
    return previous


def workers_beyond(worker_ids: Iterable[str], statefulset: str, replicas: int) -> list[str]:
    """Worker ids of pods ``<statefulset>-<ordinal>`` with ordinal >= ``replicas`` (the ones a scale-down
    removes). Ids are the pod name or start with it (``<pod>.<service>...:port``, the advertised address)."""
    pattern = re.compile(rf"^{re.escape(statefulset)}-(\d+)(?:[.:]|$)")
    return sorted(w for w in worker_ids if (m := pattern.match(w)) and int(m.group(1)) >= replicas)
