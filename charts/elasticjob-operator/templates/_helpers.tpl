{{/* Full name of the release's objects. */}}
{{- define "elasticjob-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "elasticjob-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "elasticjob-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "elasticjob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "elasticjob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "elasticjob-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The permissions the operator needs on ElasticJobs and their children: exactly the
requests it makes (tests/e2e/test_security.py compares them with the API server's audit
log; docs/operator.md says why each is needed). */}}
{{- define "elasticjob-operator.rules" -}}
- apiGroups: [elastic.pytorch.org]
  resources: [elasticjobs]
  verbs: [get, list, watch, delete]
- apiGroups: [elastic.pytorch.org]
  resources: [elasticjobs/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete, deletecollection]
- apiGroups: [""]
  resources: [services]
  verbs: [list, create, delete]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, create, delete, deletecollection]
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [deletecollection]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, create, deletecollection]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, create, deletecollection]
{{- end }}
{{- if .Values.kueue.enabled }}
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [list, watch, create, delete, deletecollection]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- end }}
{{- if ne (toString .Values.gangScheduling.enabled) "false" }}
- apiGroups: [scheduling.k8s.io]
  resources: [workloads]
  verbs: [list, create, delete, deletecollection]
{{- end }}
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end -}}

{{/* The selector labels as k=v,k2=v2: how the operator names its own pods to the etcd's
NetworkPolicy. */}}
{{- define "elasticjob-operator.selectorLabelList" -}}
{{- $pairs := list -}}
{{- range $key, $value := include "elasticjob-operator.selectorLabels" . | fromYaml -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* The shared etcd's pods: not the operator's selector labels (its Deployment would
claim them). */}}
{{- define "elasticjob-operator.sharedEtcdLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-shared-etcd
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
