// What the contract cases do not show on the wire: stored rows, handler runs
// and logs behind misconfiguration and unavailability, server errors,
// failedWrites, responses too large to store, a late handler after its
// timeout, the request body limit, key(req) and canonicalJson, for the
// Express 5 and Express 4 middleware and the Fastify plugin alike.
import { test, describe, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { db, row, newKey, send, exchange, problemOf, waitFor, frameworks, createTestOrders } from './helpers.mjs';

const pool = new pg.Pool({ max: 10 });
const NO_EXTENSION_DB = `${process.env.PGDATABASE ?? 'postgres'}_noext2`;
const NO_GRANT_ROLE = `idem_node_nogrant_${randomUUID().slice(0, 8)}`;
let noExtensionPool;
let noGrantPool;

before(async () => {
	await createTestOrders();
	await db.query(`DROP DATABASE IF EXISTS ${NO_EXTENSION_DB} WITH (FORCE)`);
	await db.query(`CREATE DATABASE ${NO_EXTENSION_DB}`);
	await db.query(`CREATE ROLE ${NO_GRANT_ROLE} LOGIN`);
	noExtensionPool = new pg.Pool({ database: NO_EXTENSION_DB, max: 2 });
	noGrantPool = new pg.Pool({ user: NO_GRANT_ROLE, max: 2 });
	// DROP DATABASE ... WITH (FORCE) ends connections the pool may still be closing
	noExtensionPool.on('error', () => {});
});

after(async () => {
	await pool.end();
	await noExtensionPool.end();
	await noGrantPool.end();
	await db.query(`DROP DATABASE IF EXISTS ${NO_EXTENSION_DB} WITH (FORCE)`);
	await db.query(`DROP ROLE IF EXISTS ${NO_GRANT_ROLE}`);
	await db.end();
});

async function ordersFor(key) {
	const { rows } = await db.query('SELECT note FROM test_orders WHERE request_key = $1', [key]);
	return rows.map((r) => r.note);
}

/* a request whose body comes in chunks, without a Content-Length */
function sendChunked(baseUrl, path, { key, parts }) {
	return exchange(baseUrl + path, {
		headers: { 'content-type': 'application/octet-stream', 'idempotency-key': key },
		parts,
	});
}

for (const fw of frameworks) {
	describe(fw.name, () => {
		test('misconfiguration is a 500 naming the cause, logged once per cause; the handler never runs', async () => {
			const logs = [];
			const log = (message) => logs.push(message);
			const noExt = await fw.start({ pool: noExtensionPool, log });
			const noGrant = await fw.start({ pool: noGrantPool, log });
			try {
				for (let i = 0; i < 3; i++) {
					const a = await send(noExt.url, '/echo', { key: newKey() });
					const p = problemOf(a, 500, 'idempotency-misconfigured');
					assert.equal(p.title, 'Idempotency middleware misconfigured');
					assert.match(p.detail, new RegExp(`not installed in database "${NO_EXTENSION_DB}": run CREATE EXTENSION idempotency`));
					assert.equal(a.headers['retry-after'], undefined);
					const b = await send(noGrant.url, '/echo', { key: newKey() });
					assert.match(problemOf(b, 500, 'idempotency-misconfigured').detail, /GRANT USAGE ON SCHEMA idempotency/);
				}
				assert.equal(logs.filter((m) => /misconfigured: The idempotency extension is not installed/.test(m)).length, 1);
				assert.equal(logs.filter((m) => /misconfigured: .*GRANT USAGE/.test(m)).length, 1);
				assert.equal(noExt.control.runs.size + noGrant.control.runs.size, 0);
			} finally {
				await noExt.close();
				await noGrant.close();
			}
		});

		test('a closed pool is a 500; a server that refuses connections is a 503 with Retry-After: 1', async () => {
			const closed = new pg.Pool({ max: 1 });
			await closed.end();
			const refused = new pg.Pool({ max: 1, port: 1 });
			const a = await fw.start({ pool: closed, log: () => {} });
			const b = await fw.start({ pool: refused, log: () => {} });
			try {
				assert.match(problemOf(await send(a.url, '/echo', { key: newKey() }), 500, 'idempotency-misconfigured').detail,
					/pool .* is closed/);
				const r = await send(b.url, '/echo', { key: newKey() });
				problemOf(r, 503, 'idempotency-unavailable');
				assert.equal(r.headers['retry-after'], '1');
			} finally {
				await a.close();
				await b.close();
				await refused.end();
			}
		});

		test('storeServerErrors: a 5xx the handler sends is stored as failed; a thrown error still releases', async () => {
			const app = await fw.start({ pool, storeServerErrors: true });
			try {
				const key = newKey();
				assert.equal((await send(app.url, '/status?code=503', { key })).status, 503);
				const r = await row(key);
				assert.equal(r.status, 'failed');
				assert.equal(r.response_code, 503);
				const again = await send(app.url, '/status?code=503', { key });
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal(app.control.count(key), 1);
				const thrown = newKey();
				assert.equal((await send(app.url, '/throw', { key: thrown })).status, 500);
				assert.equal(await row(thrown), null);
				assert.equal((await send(app.url, '/throw', { key: thrown })).status, 500);
				assert.equal(app.control.count(thrown), 2);
			} finally {
				await app.close();
			}
		});

		test('failedWrites: commit (default) keeps a stored 4xx\'s writes; rollback undoes them and still stores the 4xx', async () => {
			const committing = await fw.start({ pool });
			const rolling = await fw.start({ pool, failedWrites: 'rollback' });
			try {
				const a = newKey();
				assert.equal((await send(committing.url, '/tx-status?code=402', { key: a })).status, 402);
				assert.deepEqual(await ordersFor(a), ['402']);
				assert.equal((await row(a)).status, 'failed');
				const b = newKey();
				assert.equal((await send(rolling.url, '/tx-status?code=402', { key: b })).status, 402);
				assert.deepEqual(await ordersFor(b), []);
				const rb = await row(b);
				assert.equal(rb.status, 'failed');
				assert.equal(rb.response_code, 402);
				const again = await send(rolling.url, '/tx-status?code=402', { key: b });
				assert.equal(again.status, 402);
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal(rolling.control.count(b), 1);
				// a success keeps its writes in both modes
				const c = newKey();
				assert.equal((await send(rolling.url, '/tx-status?code=201', { key: c })).status, 201);
				assert.deepEqual(await ordersFor(c), ['201']);
				assert.equal((await row(c)).status, 'succeeded');
			} finally {
				await committing.close();
				await rolling.close();
			}
		});

		test('failedWrites rollback with storeServerErrors: a stored 5xx rolls back the writes', async () => {
			const app = await fw.start({ pool, failedWrites: 'rollback', storeServerErrors: true });
			try {
				const key = newKey();
				assert.equal((await send(app.url, '/tx-status?code=500', { key })).status, 500);
				assert.deepEqual(await ordersFor(key), []);
				assert.equal((await row(key)).status, 'failed');
			} finally {
				await app.close();
			}
		});

		test('a response too large to store: the row keeps status and headers without the body; the handler ran once', async () => {
			const app = await fw.start({ pool });
			try {
				for (const path of ['/big', '/tx-big']) {
					const key = newKey();
					const first = await send(app.url, path, { key });
					assert.equal(first.status, 201);
					assert.equal(first.bytes.length, 2 * 1024 * 1024);
					const r = await row(key);
					assert.equal(r.status, 'succeeded');
					assert.equal(r.response_code, 201);
					assert.deepEqual(r.response_body, { v: 1, headers: { location: '/big/1' }, omitted: 'too-large' });
					for (let i = 0; i < 2; i++) {
						const again = await send(app.url, path, { key });
						assert.equal(again.status, 201);
						assert.equal(again.bytes.length, 0);
						assert.equal(again.headers['idempotent-body-omitted'], 'too-large');
						assert.equal(again.headers.location, '/big/1');
					}
					assert.equal(app.control.count(key), 1);
				}
			} finally {
				await app.close();
			}
		});

		test('handlerTimeout: 504 at once; the late result is stored (autocommit) or rolled back (transactional)', async () => {
			const app = await fw.start({ pool, handlerTimeout: 1 });
			try {
				const key = newKey();
				const gate = app.control.gate(key);
				const first = await send(app.url, '/slow', { key });
				const p = problemOf(first, 504, 'idempotency-handler-timeout');
				assert.equal(p.title, 'Request handler timed out');
				assert.equal((await gate.entered.promise).signal.aborted, true);
				gate.release.resolve();
				const r = await waitFor(async () => (await row(key))?.status === 'succeeded' && row(key), 'the late result');
				assert.equal(r.response_code, 201);
				const again = await send(app.url, '/slow', { key });
				assert.equal(again.status, 201);
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal(app.control.count(key), 1);

				const tx = newKey();
				const txGate = app.control.gate(tx);
				problemOf(await send(app.url, '/tx', { key: tx, body: '{"note":"late"}' }), 504, 'idempotency-handler-timeout');
				txGate.release.resolve();
				// the key is free once the late transaction rolled back, and nothing of it stays
				await waitFor(async () => (await send(app.url, '/tx', { key: tx, body: '{"note":"again"}' })).status === 201,
					'a retry that runs');
				assert.deepEqual(await ordersFor(tx), ['again']);
				assert.equal((await row(tx)).attempt, 1);
			} finally {
				await app.close();
			}
		});

		test('maxBodySize: a chunked body over the limit is refused with 413 without using the key', async () => {
			const app = await fw.start({ pool, maxBodySize: 1000 });
			try {
				const key = newKey();
				const over = await sendChunked(app.url, '/echo', { key, parts: [Buffer.alloc(600, 'a'), Buffer.alloc(600, 'b')] });
				assert.equal(JSON.parse(over.text).title, 'Request body too large');
				assert.equal(over.status, 413);
				assert.equal(await row(key), null);
				const fits = await sendChunked(app.url, '/echo', { key, parts: [Buffer.alloc(500, 'a'), Buffer.alloc(500, 'b')] });
				assert.equal(fits.status, 201, fits.text);
				assert.equal((await row(key)).status, 'succeeded');
			} finally {
				await app.close();
			}
		});

		test('key(req): its value replaces the header; empty, control characters, too long are refused', async () => {
			const app = await fw.start({ pool, key: (req) => req.headers['x-message-id'] ?? null });
			const optional = await fw.start({ pool, required: false, key: () => null });
			try {
				const id = newKey('msg');
				const first = await send(app.url, '/echo', { headers: { 'x-message-id': id } });
				assert.equal(first.status, 201);
				assert.equal((await row(id)).status, 'succeeded');
				problemOf(await send(app.url, '/echo', { headers: { 'x-message-id': '' } }), 400, 'idempotency-key-malformed');
				problemOf(await send(app.url, '/echo', { headers: { 'x-message-id': 'a\tb' } }), 400, 'idempotency-key-malformed');
				problemOf(await send(app.url, '/echo', { headers: { 'x-message-id': 'k'.repeat(256) } }), 400, 'idempotency-key-too-long');
				problemOf(await send(app.url, '/echo', { key: `"${newKey()}"` }), 400, 'idempotency-key-missing');
				const passed = await send(optional.url, '/echo', { key: `"${newKey()}"` });
				assert.equal(passed.status, 201);
				assert.equal(JSON.parse(passed.text).attempt, undefined, 'not covered: no attempt');
			} finally {
				await app.close();
				await optional.close();
			}
		});

		test('canonicalJson: the fingerprint holds the body as jsonb built from the text, big numbers exact', async () => {
			const app = await fw.start({ pool, canonicalJson: true });
			try {
				const key = newKey();
				const body = '{"n": 12345678901234567890, "a": [1, 2]}';
				assert.equal((await send(app.url, '/echo', { key, body })).status, 201);
				const { rows } = await db.query('SELECT fingerprint FROM idempotency.keys WHERE key = $1', [key]);
				const { rows: expected } = await db.query(
					"SELECT sha256(convert_to($1::jsonb::text, 'UTF8')) AS fp",
					[`{"method": "POST", "path": "/echo", "body": ${body}}`]);
				assert.deepEqual(rows[0].fingerprint, expected[0].fp);
				// JavaScript numbers would make these two the same request
				problemOf(await send(app.url, '/echo', { key, body: '{"n": 12345678901234567891, "a": [1, 2]}' }), 422, 'idempotency-key-reused');
				const same = await send(app.url, '/echo', { key, body: '{"a":[1,2],"n":12345678901234567890}' });
				assert.equal(same.headers['idempotent-replayed'], 'true');
				assert.equal(app.control.count(key), 1);
			} finally {
				await app.close();
			}
		});

		test('storeHeaders cannot store framing headers, even when named', async () => {
			const app = await fw.start({ pool, storeHeaders: ['X-Custom', 'content-length', 'connection', 'transfer-encoding'] });
			try {
				const key = newKey();
				await send(app.url, '/headers', { key });
				assert.deepEqual(Object.keys((await row(key)).response_body.headers).sort(), ['content-type', 'location', 'x-custom']);
			} finally {
				await app.close();
			}
		});
	});
}
