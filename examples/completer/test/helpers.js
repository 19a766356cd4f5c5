'use strict';
/*
 * helpers.js: start the service and the completer as child processes (so
 * that a test can kill the service where it says it crashes), talk to the
 * service over real HTTP, read keys back, and run the sweep.
 */

const { spawn } = require('node:child_process');
const { randomUUID } = require('node:crypto');
const path = require('node:path');
const { Pool } = require('pg');

const APP_ROLE_OPTIONS = '-c role=orders_app';
/* seconds: short, so that the crashed attempt's lease ends soon */
const LEASE = 1;

/* the test's own connection: a superuser, to read keys and run the sweep */
const db = new Pool({ max: 4 });

/*
 * Start one of src/*.js as the unprivileged role orders_app; resolves once
 * it printed a line matching `ready`.  waitForLine(re) resolves with the
 * first line of its stdout matching re.
 */
function startProcess(script, ready, env = {}) {
	const child = spawn(process.execPath, [path.join(__dirname, '..', 'src', script)], {
		env: {
			...process.env,
			IDEM_LEASE: String(LEASE),
			PGOPTIONS: APP_ROLE_OPTIONS,
			EXIT_WITH_STDIN: '1',     /* dies with the test process, whatever kills it */
			...env,
		},
		stdio: ['pipe', 'pipe', 'pipe'],
	});
	let stderr = '';
	child.stderr.on('data', (d) => { stderr += d; });
	const exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
	const lines = [];
	const watchers = [];
	let partial = '';
	child.stdout.setEncoding('utf8');
	child.stdout.on('data', (d) => {
		const parts = (partial + d).split('\n');
		partial = parts.pop();
		for (const line of parts) {
			lines.push(line);
			for (const w of [...watchers])
				if (w.re.test(line)) {
					watchers.splice(watchers.indexOf(w), 1);
					w.resolve(line);
				}
		}
	});
	const waitForLine = (re) => {
		const seen = lines.find((line) => re.test(line));
		return seen !== undefined ? Promise.resolve(seen)
			: new Promise((resolve) => watchers.push({ re, resolve }));
	};
	return new Promise((resolve, reject) => {
		waitForLine(ready).then((line) => resolve({
			line,
			child,
			exited,
			lines,
			waitForLine,
			stderr: () => stderr,
			/* SIGTERM, and the exit it leads to */
			async stop() {
				if (child.exitCode === null && child.signalCode === null)
					child.kill('SIGTERM');
				return exited;
			},
		}));
		exited.then(({ code, signal }) => reject(
			new Error(`${script} exited (${code ?? signal}) before it was ready: ${stderr}`)));
	});
}

async function startService(providerUrl, env = {}) {
	const started = await startProcess('server.js', /listening on (http:\/\/\S+)/,
		{ PORT: '0', PROVIDER_URL: providerUrl, ...env });
	return { ...started, url: started.line.match(/listening on (http:\/\/\S+)/)[1] };
}

function startCompleter(providerUrl, env = {}) {
	return startProcess('completer.js', /^completer listening/, { PROVIDER_URL: providerUrl, ...env });
}

/* POST JSON over real HTTP; returns status, headers and the exact body text */
async function post(baseUrl, urlPath, body, headers = {}) {
	const res = await fetch(baseUrl + urlPath, {
		method: 'POST',
		headers: { 'content-type': 'application/json', ...headers },
		body: JSON.stringify(body),
	});
	return { status: res.status, headers: res.headers, text: await res.text() };
}

/* the key as stored (null when absent): what the tests check between the steps */
async function stored(key, scope = 'orders') {
	const { rows } = await db.query(
		`SELECT status, attempt, token::text AS token, phase, phase_data, request, response_code,
		        lease_until <= pg_catalog.clock_timestamp() AS lease_ended
		   FROM idempotency.keys WHERE scope = $1 AND key = $2`, [scope, key]);
	return rows[0] ?? null;
}

/* wait until check() is truthy; the condition is the test's, the poll only its pace */
async function waitFor(check, what, timeoutMs = 30000) {
	const end = Date.now() + timeoutMs;
	for (;;) {
		const value = await check();
		if (value)
			return value;
		if (Date.now() > end)
			throw new Error(`timed out waiting for ${what}`);
		await new Promise((r) => setTimeout(r, 25));
	}
}

/*
 * The sweep the background worker runs once a minute: it resets the keys
 * whose lease ended and notifies their scopes, which wakes the completer.
 * The test runs it itself rather than wait for the worker.
 */
async function sweep() {
	await db.query('SELECT * FROM idempotency.idem_sweep()');
}

function newKey(label = 'order') {
	return `${label}-${randomUUID()}`;
}

module.exports = { db, startService, startCompleter, post, stored, waitFor, sweep, newKey };
