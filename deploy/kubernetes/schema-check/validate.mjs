// Validates custom resources against the JSON schemas the @kubernetes-models packages
// publish (generated from cert-manager's and the Prometheus Operator's CRDs).
// Input: a JSON array of objects on stdin. Prints one line per object; exits 1 if any
// object fails or has a kind no schema here covers.
import { Certificate } from "@kubernetes-models/cert-manager/cert-manager.io/v1/Certificate";
import { Issuer } from "@kubernetes-models/cert-manager/cert-manager.io/v1/Issuer";
import { ClusterIssuer } from "@kubernetes-models/cert-manager/cert-manager.io/v1/ClusterIssuer";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

const models = [Certificate, Issuer, ClusterIssuer, ServiceMonitor, PodMonitor, PrometheusRule];

let input = "";
for await (const chunk of process.stdin) input += chunk;
const objects = JSON.parse(input);
let failed = 0;
for (const o of objects) {
  const name = `${o.kind}/${o.metadata?.name} (${o.apiVersion})`;
  const model = models.find((m) => m.apiVersion === o.apiVersion && m.kind === o.kind);
  if (!model) {
    console.log(`FAIL ${name}: no schema here for this kind`);
    failed++;
    continue;
  }
  try {
    new model(o).validate();
    console.log(`ok   ${name}`);
  } catch (e) {
    console.log(`FAIL ${name}: ${e.message}`);
    failed++;
  }
}
console.log(`${objects.length - failed} of ${objects.length} custom resources valid`);
process.exit(failed ? 1 : 0);
