
# Copyright: the idempotency extension authors.
#
# 212_sql_edition_update.pl: the SQL edition updates from every version it
# released to the newest, through either installer, and keeps every key.
#
# The SQL edition's code is its SQL, so each release is a version of its own
# (sql-edition/versions; a released version's script is frozen as
# sql-edition/idempotency--VERSION.sql).  For each released version:
#   - it is installed as that release did, by the admin role a platform
#     gives its users ($SQL_ADMIN: no superuser, owner of the database,
#     pgtle_admin under pg_tle): through pg_tle, that version's
#     scripts registered (with the update paths between them) and CREATE
#     EXTENSION idempotency VERSION; plain, its script run into schema
#     idempotency;
#   - keys in every state are stored: finished with a response, failed,
#     pending under a live lease, pending with an ended lease (twice, one
#     at a recovery point), reset by that version's sweep, finished and
#     past its retention (not swept), and a batch claimed and finished
#     together;
#   - the newest installer runs over it, run by the same role (through
#     pg_tle it registers only
#     what is new, then ALTER EXTENSION idempotency UPDATE; plain, it
#     replaces the functions in place), and runs again without error;
#   - nothing stored changed: every row in the same place (ctid, xmin) with
#     every column, and the token sequence where it was;
#   - the version is the newest (extversion through pg_tle) and
#     idem_version() names it;
#   - the keys work with the tokens from before: finished keys replay, a
#     different request is a mismatch, the live key is in progress and its
#     holder extends, checkpoints and finishes it, the stale key is taken
#     over (attempt 2, a larger token, the recovery point it had) and its
#     old token is refused (55006), the key past its retention is claimed
#     afresh (attempt 1);
#   - a key remembered after the update (1.7.0) works: claimed and finished
#     with remember, aged past its retention by the superuser, a claim of it
#     answers expired (another request mismatch), the sweep compacts it
#     (response gone, outcome kept), idem_lookup shows remembered_until and
#     idem_forget removes it;
#   - completers (1.8.0): no stored row has a kept request, the new index
#     is there, PUBLIC may execute idem_claim_abandoned, which takes over
#     the key the old version's sweep reset and the one whose lease ended,
#     oldest first (attempt 2, a larger token, the recovery point), whose
#     old tokens are refused (55006); a claim after the update keeps its
#     request, a completer gets it back, its finish drops it, and the
#     client's retry replays that finish;
#   - the catalog is a fresh install's, definition for definition, owners
#     and privileges included (catalog_queries, and every function of the
#     schema for the plain installer, which makes no extension).
# And for each released version, in a database of its own: the privileges
# an administrator gave on the functions the update creates anew (their
# arguments or result columns changed) carry over, grantors included where
# the admin role may act as the grantor, the grantee's privilege where it
# may not; a role with EXECUTE only claims with keep_request and calls
# idem_claim_abandoned, which PUBLIC may execute.
# Against the C edition the file skips: its updates are 211_upgrade.pl's.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl), with
# IDEM_EDITION=plain or pgtle.  Port 55478 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

plan skip_all => 'C edition: its updates are tested by 211_upgrade.pl'
  unless sql_edition();

my $edition_dir = "$FindBin::Bin/../sql-edition";
my @versions = grep { /\S/ && !/^\s*#/ } split /\n/,
  slurp_file("$edition_dir/versions");
s/\s+//g for @versions;
my $newest = pop @versions;
my @released = @versions;
ok(scalar(@released) >= 1,
	'the SQL edition has released versions to update from: ' . join(', ', @released));

# The frozen script of released version $v.
sub script_of
{
	my ($v) = @_;
	return slurp_file("$edition_dir/idempotency--$v.sql");
}

# The update script from $from to $to, as scripts/sql-edition.sh picks it:
# idempotency--FROM--TO.sql when there is one, else the newer full script.
sub update_of
{
	my ($from, $to) = @_;
	my $file = "$edition_dir/idempotency--$from--$to.sql";
	return -f $file ? slurp_file($file) : script_of($to);
}

my $node = new_node('sqlupdate', port => 55478);
IdemTest::sql_admin($node);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

# As the installing role.
sub as_admin
{
	my ($db, $sql) = @_;
	return $node->safe_psql($db, $sql, extra_params => [ '-U', $SQL_ADMIN ]);
}

my $pgtle = $IdemTest::EDITION eq 'pgtle';

# A dollar quote none of the scripts contains.
my $q = '$_idempotency_update_test_$';

# Install released version $v into the new database $db, as its release's
# installer did.
sub install_released
{
	my ($db, $v) = @_;
	sql('postgres', "CREATE DATABASE $db TEMPLATE template0 OWNER $SQL_ADMIN");
	if ($pgtle)
	{
		# the versions up to $v, each registered, and the update paths
		# between neighbours, as scripts/sql-edition.sh builds them
		my @upto;
		for my $r (@released)
		{
			push @upto, $r;
			last if $r eq $v;
		}
		sql($db, "CREATE EXTENSION pg_tle");
		my $reg = '';
		for my $i (0 .. $#upto)
		{
			my $text = script_of($upto[$i]);
			$reg .=
			  $i == 0
			  ? "SELECT pgtle.install_extension('idempotency', '$upto[$i]', 'idempotency keys', $q$text$q, NULL, 'idempotency');\n"
			  : "SELECT pgtle.install_extension_version_sql('idempotency', '$upto[$i]', $q$text$q);\n"
			  . "SELECT pgtle.install_update_path('idempotency', '$upto[$i - 1]', '$upto[$i]', $q"
			  . update_of($upto[$i - 1], $upto[$i])
			  . "$q);\n";
		}
		$reg .= "SELECT pgtle.set_default_version('idempotency', '$v');\n";
		as_admin($db, $reg);
		as_admin($db, "CREATE EXTENSION idempotency VERSION '$v'");
	}
	else
	{
		as_admin($db,
			"BEGIN;\nCREATE SCHEMA idempotency;\n"
			  . script_of($v) . "\nCOMMIT;");
	}
	return;
}

# Run the newest installer into $db (and update the extension through
# pg_tle).
sub install_newest
{
	my ($db) = @_;
	as_admin($db, IdemTest::installer_sql());
	as_admin($db, 'ALTER EXTENSION idempotency UPDATE') if $pgtle;
	return;
}

# A fresh install of the newest version, to compare catalogs with.
sql('postgres', "CREATE DATABASE fresh TEMPLATE template0 OWNER $SQL_ADMIN");
sql('fresh', 'CREATE EXTENSION pg_tle') if $pgtle;
as_admin('fresh', IdemTest::installer_sql());
as_admin('fresh', 'CREATE EXTENSION idempotency') if $pgtle;

# Every function of schema idempotency: definition, owner and privileges.
my $schema_functions_sql =
    "SELECT string_agg(pg_get_functiondef(p.oid) || 'owner ' || p.proowner::regrole "
  . "|| ', acl ' || coalesce(p.proacl::text, 'default'), E'\\n' "
  . "ORDER BY p.oid::regprocedure::text) FROM pg_proc p "
  . "WHERE p.pronamespace = 'idempotency'::regnamespace";
my $seq_sql = 'SELECT last_value FROM idempotency.token_seq';

for my $v (@released)
{
	(my $db = "from_$v") =~ s/\W/_/g;
	install_released($db, $v);
	is(sql($db, 'SELECT idempotency.idem_version()') =~ /^\Q$v\E(\.|$)/ ? 1 : 0,
		1, "$v: installed, idem_version() names a release of $v");

	# keys in every state; first the one that version's sweep resets, while
	# it is the only key
	my $reset = claim($node, $db, "'reset', '{\"n\": 10}', lease => '1 second'");
	ok(wait_lease_over($node, $db, '', 'reset'), "$v: the lease of key 'reset' ended");
	is(sql($db, "SELECT concat_ws('|', expired, reset) FROM idempotency.idem_sweep()"),
		'0|1', "$v: that version's sweep reset it");
	my $done = claim($node, $db, "'done', '{\"n\": 1}', lease => '1 hour'");
	sql($db,
		"SELECT idempotency.idem_finish('done', $done->{token}, 200, '{\"paid\": true}')");
	my $failed = claim($node, $db, "'failed', '{\"n\": 2}', lease => '1 hour'");
	sql($db,
		"SELECT idempotency.idem_finish('failed', $failed->{token}, 502, '{\"error\": \"upstream\"}', status => 'failed')"
	);
	my $live = claim($node, $db, "'live', '{\"n\": 3}', lease => '1 hour'");
	my $stale = claim($node, $db, "'stale', '{\"n\": 4}', lease => '1 second'");
	my $orphan = claim($node, $db, "'orphan', '{\"n\": 9}', lease => '1 second'");
	finish_key($node, $db, 'gone', '1 second', q('{"old": true}'));
	sql($db,
		"SELECT idempotency.idem_checkpoint('stale', $stale->{token}, 'charged', '{\"charge\": \"ch_1\"}')"
	);
	is(sql($db,
			"SELECT count(*) FROM idempotency.idem_finish_many(ARRAY['b1', 'b2'], "
			  . "(SELECT array_agg(token ORDER BY key) FROM idempotency.idem_claim_many(ARRAY['b1', 'b2'], "
			  . "ARRAY['{\"b\": 1}', '{\"b\": 2}']::jsonb[], lease => '1 hour')), ARRAY[200, 200])"),
		'2', "$v: a batch claimed and finished");
	sql($db,
		"SELECT idempotency.idem_checkpoint('orphan', $orphan->{token}, 'packed', '{\"box\": 9}')"
	);
	ok(wait_lease_over($node, $db, '', 'stale'), "$v: the stale key's lease ended");
	ok(wait_lease_over($node, $db, '', 'orphan'), "$v: the orphan key's lease ended");
	ok(wait_past_retention($node, $db, 'gone'), "$v: the finished key 'gone' is past its retention");

	my $rows_before = key_rows($node, $db);
	my $seq_before = sql($db, $seq_sql);

	install_newest($db);
	install_newest($db);
	pass("$v: the newest installer ran over it, twice");

	is(key_rows($node, $db), $rows_before,
		"$v: every stored row is where it was, every column unchanged");
	is(sql($db, $seq_sql), $seq_before, "$v: the token sequence did not move");
	is(sql($db, 'SELECT idempotency.idem_version()'), $newest,
		"$v: idem_version() names the newest version, $newest");
	is(sql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
		$newest, "$v: the extension is at $newest")
	  if $pgtle;

	# the keys, with the tokens from before
	is_deeply(claim($node, $db, "'done', '{\"n\": 1}'"),
		replay_row('succeeded', 200, body_md5($node, $db, q('{"paid": true}'))),
		"$v: the finished key replays its response");
	is_deeply(claim($node, $db, "'failed', '{\"n\": 2}'"),
		replay_row('failed', 502, body_md5($node, $db, q('{"error": "upstream"}'))),
		"$v: the failed key replays its response");
	is_deeply(claim($node, $db, "'done', '{\"n\": 99}'"),
		mismatch_row(), "$v: another request under a finished key is a mismatch");
	is(claim($node, $db, "'live', '{\"n\": 3}'")->{outcome},
		'in_progress', "$v: the live key is in progress");
	is(sql($db,
			"SELECT idempotency.idem_extend('live', $live->{token}, '2 hours') > now() + interval '1 hour'"),
		't', "$v: the live key's holder extends it with its token from before");
	is(sqlstate_of($node, $db,
			"SELECT idempotency.idem_checkpoint('live', $live->{token}, 'shipped', '{\"parcel\": 7}')"),
		'00000', "$v: and checkpoints it");
	is(sql($db,
			"SELECT idempotency.idem_finish('live', $live->{token}, 201, '{\"id\": 3}') IS NOT NULL"),
		't', "$v: and finishes it");
	is_deeply(claim($node, $db, "'live', '{\"n\": 3}'"),
		replay_row('succeeded', 201, body_md5($node, $db, q('{"id": 3}'))),
		"$v: the live key replays the finish");
	is(sql($db,
			"SELECT concat_ws('|', outcome, attempt, token > $seq_before, phase, phase_data) "
			  . "FROM idempotency.idem_claim('stale', '{\"n\": 4}')"),
		'claimed|2|t|charged|{"charge": "ch_1"}',
		"$v: the stale key is taken over: attempt 2, a larger token, its recovery point");
	is(sqlstate_of($node, $db,
			"SELECT idempotency.idem_finish('stale', $stale->{token}, 200)"),
		'55006', "$v: the stale key's old token is refused (55006)");
	is(sql($db,
			"SELECT concat_ws('|', outcome, attempt) FROM idempotency.idem_claim('gone', '{\"n\": 5}')"),
		'claimed|1', "$v: the key past its retention is claimed afresh");

	# completers, new in 1.8.0
	is(sql($db, 'SELECT count(*) FROM idempotency.keys WHERE request IS NOT NULL'),
		'0', "$v: no stored key has a kept request");
	is(sql($db, "SELECT pg_get_indexdef('idempotency.keys_abandoned_idx'::regclass)"),
		'CREATE INDEX keys_abandoned_idx ON idempotency.keys USING btree (scope, created_at) '
		  . 'WHERE (token IS NULL)',
		"$v: keys_abandoned_idx indexes the reset keys by scope and lease");
	is(sql($db,
			"SELECT has_function_privilege('public', "
			  . "'idempotency.idem_claim_abandoned(text,integer,interval)', 'EXECUTE')"),
		't', "$v: PUBLIC may execute idem_claim_abandoned");
	is(sql($db,
			"SELECT string_agg(concat_ws('|', key, attempt, token > $seq_before, request, phase, "
			  . "phase_data), ',') FROM idempotency.idem_claim_abandoned(max_keys => 10)"),
		'reset|2|t,orphan|2|t|packed|{"box": 9}',
		"$v: a completer takes over the key the old sweep reset and the one whose lease "
		  . "ended, oldest first: attempt 2, a larger token, the recovery point");
	is(sqlstate_of($node, $db, "SELECT idempotency.idem_finish('reset', $reset->{token}, 200)"),
		'55006', "$v: the reset key's old token is refused (55006)");
	is(sqlstate_of($node, $db, "SELECT idempotency.idem_finish('orphan', $orphan->{token}, 200)"),
		'55006', "$v: the orphan key's old token is refused (55006)");
	is(claim($node, $db, "'kept', '{\"n\": 8}', lease => '1 second', keep_request => true")
		  ->{outcome},
		'claimed', "$v: a key claimed with keep_request");
	is(sql($db, "SELECT request FROM idempotency.keys WHERE key = 'kept'"),
		'{"n": 8}', "$v: the key keeps its request");
	ok(wait_lease_over($node, $db, '', 'kept'), "$v: its lease ended");
	my ($kept_token) = sql($db,
		    "SELECT concat_ws('|', key, attempt, request, token) "
		  . "FROM idempotency.idem_claim_abandoned()") =~ /^kept\|2\|\{"n": 8\}\|(\d+)$/;
	ok(defined $kept_token, "$v: a completer gets it back with its request");
	is(sql($db,
			"SELECT idempotency.idem_finish('kept', $kept_token, 201, '{\"id\": 8}') IS NOT NULL; "
			  . "SELECT request IS NULL FROM idempotency.keys WHERE key = 'kept'"),
		"t\nt", "$v: the completer's finish drops the kept request");
	is_deeply(claim($node, $db, "'kept', '{\"n\": 8}'"),
		replay_row('succeeded', 201, body_md5($node, $db, q('{"id": 8}'))),
		"$v: and the client's retry replays that finish");

	# a remembered key, new in 1.7.0
	my $rem = claim($node, $db, "'remembered', '{\"n\": 6}', remember => '1 hour'");
	is($rem->{outcome}, 'claimed', "$v: a key claimed with remember");
	is(sql($db,
			"SELECT idempotency.idem_finish('remembered', $rem->{token}, 201, '{\"id\": 6}') IS NOT NULL"),
		't', "$v: and finished");
	sql($db,
		    "UPDATE idempotency.keys SET expires_at = now() - interval '1 minute', "
		  . "sweep_at = now() - interval '1 minute' WHERE key = 'remembered'");
	is_deeply(claim($node, $db, "'remembered', '{\"n\": 6}'"),
		{ %{ mismatch_row() }, outcome => 'expired', status => 'succeeded', response_code => 201 },
		"$v: past its retention the remembered key answers expired, with its status and code");
	is(claim($node, $db, "'remembered', '{\"n\": 7}'")->{outcome},
		'mismatch', "$v: another request under it is a mismatch");
	cmp_ok(sql($db, 'SELECT expired FROM idempotency.idem_sweep()'), '>=', 1,
		"$v: the sweep counts it expired");
	is(sql($db,
			"SELECT concat_ws('|', status, response_code, response_body IS NULL, phase IS NULL, "
			  . "sweep_at = expires_at + remember) FROM idempotency.keys WHERE key = 'remembered'"),
		'succeeded|201|t|t|t', "$v: and compacts it: its response gone, its outcome kept");
	is(sql($db,
			"SELECT concat_ws('|', status, response_code, response_body IS NULL, "
			  . "remembered_until = expires_at + interval '1 hour') "
			  . "FROM idempotency.idem_lookup('remembered')"),
		'succeeded|201|t|t', "$v: idem_lookup shows it with remembered_until");
	is(claim($node, $db, "'remembered', '{\"n\": 6}'")->{outcome},
		'expired', "$v: compacted, it still answers expired");
	is(sql($db, "SELECT idempotency.idem_forget('remembered')"),
		't', "$v: idem_forget removes it");
	is(claim($node, $db, "'remembered', '{\"n\": 6}'")->{outcome},
		'claimed', "$v: and it runs again");

	# the catalog
	my %catalog = (catalog_queries(),
		'every function of the schema (definition, owner, privileges)' =>
		  $schema_functions_sql);
	for my $what (sort keys %catalog)
	{
		is(sql($db, $catalog{$what}), sql('fresh', $catalog{$what}),
			"$v: $what as a fresh install's");
	}
}

# The privileges an administrator gave carry over to the functions the
# update creates anew.  regress_app may execute idem_claim and idem_lookup,
# regress_lead idem_claim with the grant option, regress_worker idem_claim
# by regress_lead's grant (the admin role is a member of regress_lead, so
# it grants again as regress_lead), regress_monitor stats_key_counts and
# stats_counters (revoked from PUBLIC, as idem_claim and idem_lookup are),
# and regress_helper idem_finish by the grant of regress_other, a role the
# admin may not act as: granted again by the owner where the update creates
# idem_finish anew (from a version before 1.7.0), kept as it was otherwise.
my @roles = qw(regress_app regress_lead regress_worker regress_monitor regress_other
  regress_helper);
sql('postgres', join('', map { "CREATE ROLE $_; " } @roles)
	  . "GRANT regress_lead TO $SQL_ADMIN");
my $granted = "'idem_claim', 'idem_lookup', 'idem_finish', 'stats_counters', 'stats_key_counts'";

# Is version $x older than version $y (numbers separated by dots)?
sub older_than
{
	my ($x, $y) = @_;
	my @x = split /\./, $x;
	my @y = split /\./, $y;
	for my $i (0 .. 2)
	{
		my ($p, $q) = ($x[$i] // 0, $y[$i] // 0);
		return $p < $q if $p != $q;
	}
	return 0;
}

# "name(arguments) owner acl" of the granted functions in $db.
sub granted_acls
{
	my ($db) = @_;
	return sql($db,
		    "SELECT string_agg(concat_ws(' ', p.proname, p.proowner::regrole, p.proacl), "
		  . "E'\\n' ORDER BY p.proname) FROM pg_proc p "
		  . "WHERE p.pronamespace = 'idempotency'::regnamespace AND p.proname IN ($granted)");
}

# Who may execute them: "function:role=bool,...".
sub may_execute
{
	my ($db) = @_;
	return sql($db,
		    "SELECT string_agg(p.proname || ':' || r || '=' || "
		  . "has_function_privilege(r, p.oid, 'EXECUTE'), ',' ORDER BY p.proname, r) "
		  . "FROM pg_proc p, unnest(ARRAY['public', "
		  . join(', ', map { "'$_'" } @roles)
		  . "]) AS r WHERE p.pronamespace = 'idempotency'::regnamespace "
		  . "AND p.proname IN ($granted)");
}

for my $v (@released)
{
	(my $db = "acl_$v") =~ s/\W/_/g;
	install_released($db, $v);
	sql($db, qq{
GRANT USAGE ON SCHEMA idempotency TO } . join(', ', @roles) . qq{;
REVOKE EXECUTE ON FUNCTION idempotency.idem_claim FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.idem_claim TO regress_app;
GRANT EXECUTE ON FUNCTION idempotency.idem_claim TO regress_lead WITH GRANT OPTION;
REVOKE EXECUTE ON FUNCTION idempotency.idem_lookup FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.idem_lookup TO regress_app;
REVOKE EXECUTE ON FUNCTION idempotency.stats_key_counts FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.stats_key_counts TO regress_monitor;
REVOKE EXECUTE ON FUNCTION idempotency.stats_counters FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.stats_counters TO regress_monitor;
GRANT EXECUTE ON FUNCTION idempotency.idem_finish TO regress_other WITH GRANT OPTION;
SET ROLE regress_lead;
GRANT EXECUTE ON FUNCTION idempotency.idem_claim TO regress_worker;
SET ROLE regress_other;
GRANT EXECUTE ON FUNCTION idempotency.idem_finish TO regress_helper;
RESET ROLE;
});
	my $acls = granted_acls($db);
	my $may = may_execute($db);
	like($acls, qr/^idem_claim \Q$SQL_ADMIN\E \{.*regress_worker=X\/regress_lead/m,
		"$db: under $v, regress_lead granted EXECUTE on idem_claim to regress_worker");

	install_newest($db);
	install_newest($db);
	my $expect = $acls;
	$expect =~ s/regress_helper=X\/regress_other/regress_helper=X\/$SQL_ADMIN/
	  if older_than($v, '1.7.0');
	is(granted_acls($db), $expect,
		"$db: the functions keep their owner and privileges, by the same grantors "
		  . "but regress_other's where the owner granted it again");
	is(may_execute($db), $may, "$db: the same roles may execute them");
	like($may, qr/idem_claim:public=false.*idem_claim:regress_worker=true/,
		"$db: PUBLIC may not execute idem_claim, regress_worker may");
	is(sql($db,
			"SELECT count(*) FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace "
			  . "AND (proname LIKE '\\_parked\\_%' OR proname LIKE '\\_update\\_%')"),
		'0', "$db: no function of the older version, nor the update's helpers, is left");
	is(sql($db,
			"SET ROLE regress_worker; SELECT outcome FROM idempotency.idem_claim('w', '{\"w\": 1}', "
			  . "remember => '1 hour', keep_request => true)"),
		'claimed', "$db: regress_worker claims a key, remembered, its request kept");
	is(sql($db,
			"SET ROLE regress_worker; SELECT count(*) FROM idempotency.idem_claim_abandoned('w')"),
		'0', "$db: and calls idem_claim_abandoned, which PUBLIC may execute");
	is(sqlstate_of($node, $db,
			"SET ROLE regress_monitor; SELECT * FROM idempotency.idem_claim('m')"),
		'42501', "$db: a role without the grant may not");
	sql('postgres', "DROP DATABASE $db");
}
sql('postgres', 'DROP ROLE ' . join(', ', @roles));

done_testing();
