'use strict';
/*
 * helpers.js: start the service as a child process (so that a test can
 * SIGKILL or SIGSTOP it), talk to it over real HTTP, read keys back.
 */

const { spawn } = require('node:child_process');
const { randomUUID } = require('node:crypto');
const path = require('node:path');
const { Pool } = require('pg');

const SERVER = path.join(__dirname, '..', 'src', 'server.js');
const APP_ROLE_OPTIONS = '-c role=payments_app';
const LEASE_MS = 2000;

/* the test's own connection: a superuser, to read keys and business rows */
const db = new Pool({ max: 4 });

/*
 * Start src/server.js with the test settings; resolves once it listens.
 * The service runs as the unprivileged role payments_app.  waitForLine(re)
 * resolves with the first line of its stdout that matches re.
 */
function startService(downstreamUrl, extraEnv = {}) {
	const child = spawn(process.execPath, [SERVER], {
		env: {
			...process.env,
			PORT: '0',
			DOWNSTREAM_URL: downstreamUrl,
			IDEM_LEASE: String(LEASE_MS / 1000),
			EXAMPLE_FAULTS: '1',
			PGOPTIONS: APP_ROLE_OPTIONS,
			EXIT_WITH_STDIN: '1',     /* dies with the test process, whatever kills it */
			...extraEnv,
		},
		stdio: ['pipe', 'pipe', 'pipe'],
	});
	let stderr = '';
	child.stderr.on('data', (d) => { stderr += d; });
	const exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
	/* stdout lines, and the tests waiting for one */
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
	/* the first stdout line (printed so far or later) matching re */
	const waitForLine = (re) => {
		const seen = lines.find((line) => re.test(line));
		return seen !== undefined ? Promise.resolve(seen)
			: new Promise((resolve) => watchers.push({ re, resolve }));
	};
	return new Promise((resolve, reject) => {
		waitForLine(/listening on (http:\/\/\S+)/).then((line) => resolve({
			url: line.match(/listening on (http:\/\/\S+)/)[1],
			child,
			exited,
			waitForLine,
			stderr: () => stderr,
			async stop() {
				if (child.exitCode === null && child.signalCode === null) {
					child.kill('SIGTERM');
					await exited;
				}
			},
		}));
		exited.then(({ code, signal }) => reject(
			new Error(`service exited (${code ?? signal}) before listening: ${stderr}`)));
	});
}

/* POST JSON over real HTTP; returns status, headers and the exact body text */
async function post(baseUrl, urlPath, body, headers = {}) {
	const res = await fetch(baseUrl + urlPath, {
		method: 'POST',
		headers: { 'content-type': 'application/json', ...headers },
		body: typeof body === 'string' ? body : JSON.stringify(body),
	});
	return { status: res.status, headers: res.headers, text: await res.text() };
}

function json(answer) {
	return JSON.parse(answer.text);
}

/* the key's state through the extension (null when absent) */
async function lookup(key, scope = '') {
	const { rows } = await db.query(
		'SELECT * FROM idempotency.idem_lookup(key => $1, scope => $2)', [key, scope]);
	return rows[0] ?? null;
}

function newKey(label = 'k') {
	return `${label}-${randomUUID()}`;
}

function sleep(ms) {
	return new Promise((resolve) => setTimeout(resolve, ms));
}

/*
 * Retry a request the way a well-behaved client does: on 409, wait for
 * Retry-After and send it again.  Returns the final answer and the 409s seen.
 */
async function retryUntilSettled(send, maxTries = 30) {
	const conflicts = [];
	for (let i = 0; i < maxTries; i++) {
		const answer = await send();
		if (answer.status !== 409)
			return { answer, conflicts };
		conflicts.push(answer);
		const seconds = Number(answer.headers.get('retry-after'));
		await sleep(Number.isInteger(seconds) && seconds > 0 ? seconds * 1000 : 1000);
	}
	throw new Error('still 409 after many retries');
}

module.exports = {
	db, startService, post, json, lookup, newKey, sleep, retryUntilSettled,
	APP_ROLE_OPTIONS, LEASE_MS,
};
