{{/* The release's full name: names every object, and the Lease and state with it. */}}
{{- define "stanch.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "stanch.gatewayName" -}}
{{- printf "%s-gateway" (include "stanch.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "stanch.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* What selects the controller's pods (never changes across upgrades). */}}
{{- define "stanch.selectorLabels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end -}}

{{- define "stanch.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "stanch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "stanch.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "stanch.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the role tokens: the user's, or the chart's. */}}
{{- define "stanch.secretName" -}}
{{- default (printf "%s-tokens" (include "stanch.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The controller's Service, as gateways and Alertmanager reach it. */}}
{{- define "stanch.url" -}}
{{- printf "http://%s.%s.svc:%d" (include "stanch.fullname" .) .Release.Namespace (int .Values.service.port) -}}
{{- end -}}

{{/* Where the role tokens are mounted, one file a key. */}}
{{- define "stanch.tokenDir" -}}/etc/stanch/tokens{{- end -}}

{{/* The controller's configuration file: the user's, with the token files. */}}
{{- define "stanch.config" -}}
{{- $auth := dict "ingest_token_file" (printf "%s/ingest-token" (include "stanch.tokenDir" .)) "report_token_file" (printf "%s/report-token" (include "stanch.tokenDir" .)) "admin_token_file" (printf "%s/admin-token" (include "stanch.tokenDir" .)) "read_token_file" (printf "%s/read-token" (include "stanch.tokenDir" .)) -}}
{{- toYaml (merge (dict "auth" $auth) (deepCopy .Values.config)) -}}
{{- end -}}

{{/* The gateway's configuration file: the user's, with how it reaches the controller. */}}
{{- define "stanch.gatewayConfig" -}}
{{- $controller := dict "url" (include "stanch.url" .) "token_file" "/etc/stanch-gateway/tokens/read-token" "report_token_file" "/etc/stanch-gateway/tokens/report-token" "state_file" "/var/lib/stanch-gateway/routes.json" -}}
{{- toYaml (merge (dict "controller" $controller) (deepCopy .Values.gateway.config)) -}}
{{- end -}}

{{/*
Pod anti-affinity spreading one component's replicas over nodes; `affinity` wins.
Arguments: (list $root $values $selectorTemplate).
*/}}
{{- define "stanch.affinity" -}}
{{- $root := index . 0 -}}
{{- $values := index . 1 -}}
{{- $selector := include (index . 2) $root | fromYaml -}}
{{- if $values.affinity -}}
{{- toYaml $values.affinity -}}
{{- else if eq $values.podAntiAffinity "hard" -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- toYaml $selector | nindent 10 }}
{{- else if eq $values.podAntiAffinity "soft" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- toYaml $selector | nindent 12 }}
{{- end -}}
{{- end -}}

{{/* What the chart refuses to render, with why. */}}
{{- define "stanch.validate" -}}
{{- if and (gt (int .Values.replicas) 1) (ne .Values.store "kubernetes") -}}
{{- fail (printf "replicas is %d but store is %q: only store: kubernetes shares state between replicas and elects one leader; with the %s store each replica would decide on its own state and they would publish conflicting route tables. Set replicas: 1, or store: kubernetes." (int .Values.replicas) .Values.store .Values.store) -}}
{{- end -}}
{{- if and .Values.persistence.enabled (ne .Values.store "file") -}}
{{- fail (printf "persistence.enabled is true but store is %q: the volume holds the file store's state only; set store: file, or persistence.enabled: false." .Values.store) -}}
{{- end -}}
{{- if and .Values.gateway.enabled (not .Values.gateway.config.models) -}}
{{- fail "gateway.enabled is true but gateway.config.models is empty: the gateway needs its models and their endpoints (docs/gateway.md)." -}}
{{- end -}}
{{- end -}}

{{/* With kubernetesPolicies: read the policies, write their status and Events. */}}
{{- define "stanch.policyRules" -}}
- apiGroups: [stanch.dev]
  resources: [stanchpolicies]
  verbs: [list, watch]
- apiGroups: [stanch.dev]
  resources: [stanchpolicies/status]
  verbs: [patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create]
{{- end -}}
