// Creates a blob container on an Azurite blob service, signed with Azurite's well-known
// development account key (object_store, like the clouds' own SDKs, creates no containers).
// usage: node create-container.js <blob service url> <container>
"use strict";
const crypto = require("node:crypto");
const http = require("node:http");

const ACCOUNT = "devstoreaccount1";
const KEY =
  "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

const [service, container] = process.argv.slice(2);
if (!service || !container) {
  console.error("usage: node create-container.js <blob service url> <container>");
  process.exit(2);
}
const url = new URL(`${service.replace(/\/$/, "")}/${ACCOUNT}/${container}?restype=container`);
const date = new Date().toUTCString();
const version = "2021-08-06";
// Shared Key: the verb, eleven standard headers (all empty here), the x-ms- headers, the resource.
const toSign = [
  "PUT", "", "", "", "", "", "", "", "", "", "", "",
  `x-ms-date:${date}\nx-ms-version:${version}`,
  `/${ACCOUNT}${url.pathname}\nrestype:container`,
].join("\n");
const signature = crypto
  .createHmac("sha256", Buffer.from(KEY, "base64"))
  .update(toSign, "utf8")
  .digest("base64");
const request = http.request(url, {
  method: "PUT",
  headers: {
    "x-ms-date": date,
    "x-ms-version": version,
    "Content-Length": "0",
    Authorization: `SharedKey ${ACCOUNT}:${signature}`,
  },
});
request.on("response", (response) => {
  let body = "";
  response.on("data", (chunk) => (body += chunk));
  response.on("end", () => {
    if (response.statusCode === 201 || response.statusCode === 409) process.exit(0);
    console.error(`creating container ${container}: HTTP ${response.statusCode}: ${body}`);
    process.exit(1);
  });
});
request.on("error", (error) => {
  console.error(`creating container ${container} at ${service}: ${error.message}`);
  process.exit(1);
});
request.end();
