-- Argo CD health of a pagoda.dev ModelDeployment, from the conditions the operator writes.
-- argocd-cm: resource.customizations.health.pagoda.dev_ModelDeployment: <this script>
local hs = {status = "Progressing", message = "waiting for the operator"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local gen = obj.metadata.generation
if gen ~= nil and (obj.status.observedGeneration == nil or obj.status.observedGeneration < gen) then
  hs.message = "the operator has not acted on the latest spec yet"
  return hs
end
local c = {}
for _, cond in ipairs(obj.status.conditions) do
  c[cond.type] = cond
end
local function text(cond)
  return (cond.reason or "") .. ": " .. (cond.message or "")
end
if c.Degraded ~= nil and c.Degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = text(c.Degraded)
  return hs
end
if c.KVIntegrityDegraded ~= nil and c.KVIntegrityDegraded.status == "True" then
  hs.status = "Degraded"
  hs.message = text(c.KVIntegrityDegraded)
  return hs
end
if c.Ready ~= nil and c.Ready.reason == "Paused" then
  hs.status = "Suspended"
  hs.message = text(c.Ready)
  return hs
end
if c.Progressing ~= nil and c.Progressing.status == "True" then
  hs.message = text(c.Progressing)
  return hs
end
if c.Ready ~= nil and c.Ready.status == "True" then
  hs.status = "Healthy"
  hs.message = text(c.Ready)
  return hs
end
if c.Ready ~= nil then
  hs.message = text(c.Ready)
end
return hs
