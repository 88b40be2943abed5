//go:build tools

// Package build pins the programs' packages so that `go mod tidy` keeps what they need; the
// binaries themselves are built from k8s.io/kubernetes/cmd/... (podmigrate.kube.build).
package build

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-proxy/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
	_ "k8s.io/kubernetes/cmd/kubelet/app"
	_ "k8s.io/kubectl/pkg/cmd"
)
