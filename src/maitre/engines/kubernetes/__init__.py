"""Kubernetes: the ``MaitreJob`` custom resource (:mod:`.crd`, generated from the job manifest's
model) and the operator that acts on it (:mod:`.operator`: ``maitre operator``)."""
