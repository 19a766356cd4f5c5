
# Copyright: the idempotency extension authors.
#
# 207_upgrade_1_2.pl: ALTER EXTENSION idempotency UPDATE to 1.2.
#
# What it proves:
#   - a 1.1 database full of keys (finished ones, a pending one under a live
#     lease, one whose lease ended) updates to 1.2 without touching a stored
#     row (same ctid and xmin, every column identical) or the token sequence;
#   - after the update the finished keys replay, the owner of the pending
#     key extends and finishes it with the token it got from 1.1, the dead
#     token of the key whose lease ended is refused and the key is taken over
#     as attempt 2 with a larger token;
#   - idem_version() answers the library's major.minor.patch, whose
#     major.minor is the control file's default_version; on PostgreSQL 18
#     and later pg_get_loaded_modules() shows the library under its name
#     with that version;
#   - the update from 1.1 and the one from 1.0 in one ALTER EXTENSION (1.0 to
#     1.1 to 1.2) both give the catalog of a fresh 1.2 install, by the
#     comparisons 206_upgrade.pl makes for 1.1;
#   - privileges an administrator set on idem_claim carry over both ways,
#     and leave nothing that keeps the granted roles from being dropped;
#   - on PostgreSQL 17 and later, a database that the first release of the
#     1.0 to 1.1 update left with role dependencies of initial privileges
#     that no initial privileges back (pg_shdepend, deptype 'i') is repaired
#     by the update to 1.2: DROP ROLE works again.  PostgreSQL 15 and 16
#     record no such dependencies; there that part is skipped.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).  Port
# 55471 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use List::Util qw(max);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# No sweeps: the key whose lease ended stays pending until the test takes it
# over, and no finished key's sweep_at moves.
my $node = new_node('upgrade_1_2', port => 55471,
	init => [ extra => [ '--encoding=UTF8', '--locale=C' ] ],
	conf => ['idempotency.sweep_interval = 0']);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

# "extension version|whether idem_version() exists"
sub ext_state
{
	my ($db) = @_;
	return sql($db,
		    "SELECT concat_ws('|', extversion, "
		  . "to_regprocedure('idempotency.idem_version()') IS NOT NULL) "
		  . "FROM pg_extension WHERE extname = 'idempotency'");
}

my $granted_roles = 'regress_lead, regress_worker, "Regress App"';

# =========================================================================
# A 1.1 database with keys in every state
# =========================================================================
sql('postgres', 'CREATE DATABASE up');
sql('up', "CREATE EXTENSION idempotency VERSION '1.1'");
is(ext_state('up'), '1.1|f', 'up: 1.1 is installed, without idem_version()');

my %body = (
	done   => q{'{"charge": "ch_1", "total": 100.0}'},
	failed => q{'{"error": "card declined"}'},
	live   => q{'{"late": 1}'},
	ended  => q{'{"attempt": 2}'},
);
my %md5;
$md5{$_} = body_md5($node, 'up', $body{$_}) foreach keys %body;

# Every key is claimed under 1.1 with the request {"k": <its name>}.
my %token;
foreach my $key (qw(done failed live ended))
{
	my $lease = $key eq 'ended' ? '10 ms' : '1 hour';
	my $c = claim($node, 'up', qq{'$key', request => '{"k": "$key"}', lease => '$lease'});
	is($c->{outcome}, 'claimed', "up: $key is claimed under 1.1");
	$token{$key} = $c->{token};
}
sql('up', "SELECT idempotency.idem_finish('done', $token{done}, 201, $body{done})");
sql('up',
	    "SELECT idempotency.idem_finish('failed', $token{failed}, 402, $body{failed}, "
	  . "status => 'failed')");
ok(wait_lease_over($node, 'up', '', 'ended'), 'up: the lease of "ended" has run out');

my $seq_sql = 'SELECT last_value FROM idempotency.token_seq';
my $rows = key_rows($node, 'up');
my $seq = sql('up', $seq_sql);
is($seq, max(values %token), 'up: the sequence stands at the largest token issued');

# =========================================================================
# The update
# =========================================================================
is(sqlstate_of($node, 'up', "ALTER EXTENSION idempotency UPDATE TO '1.2'"), '00000',
	'up: ALTER EXTENSION idempotency UPDATE TO \'1.2\' succeeds');
is(ext_state('up'), '1.2|t', 'up: 1.2, with idem_version()');
is(key_rows($node, 'up'), $rows,
	'up: every stored row is the same tuple (ctid, xmin), column for column');
is(sql('up', $seq_sql), $seq, 'up: the token sequence did not move');

# idem_version() reports the loaded library, which ships with the newest
# install script: its major.minor is the control file's default_version,
# whichever version this database was updated to.
my $version = sql('up', 'SELECT idempotency.idem_version()');
like($version, qr/^\d+\.\d+\.\d+$/, 'up: idem_version() answers major.minor.patch');
my ($major_minor) = $version =~ /^(\d+\.\d+)\./;
is( $major_minor,
	sql('up', "SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency'"),
	'up: its major.minor is the default version the library ships with');
SKIP:
{
	skip 'pg_get_loaded_modules() and a module\'s version exist from PostgreSQL 18 on', 1
	  if sql('up', 'SHOW server_version_num') < 180000;
	is( sql('up',
			    "SELECT module_name || ' ' || version FROM pg_get_loaded_modules() "
			  . "WHERE file_name = 'idempotency.so'"),
		"idempotency $version", 'up: pg_get_loaded_modules() names the library and its version');
}

# The keys work on, with the tokens 1.1 issued.
is_deeply(claim($node, 'up', q{'done', request => '{"k": "done"}'}),
	replay_row('succeeded', 201, $md5{done}), 'up: done replays its stored success');
is_deeply(claim($node, 'up', q{'failed', request => '{"k": "failed"}'}),
	replay_row('failed', 402, $md5{failed}), 'up: failed replays its stored failure');
is_deeply(claim($node, 'up', q{'done', request => '{"k": "other"}'}),
	mismatch_row(), 'up: done with another request is a mismatch');
is(claim($node, 'up', q{'live', request => '{"k": "live"}'})->{outcome}, 'in_progress',
	'up: live is still in progress');
is(sqlstate_of($node, 'up', "SELECT idempotency.idem_extend('live', $token{live}, '2 hours')"),
	'00000', 'up: live is extended with its 1.1 token');
is( sqlstate_of($node, 'up',
		"SELECT idempotency.idem_finish('live', $token{live}, 200, $body{live})"),
	'00000', 'up: live is finished with its 1.1 token');
is_deeply(claim($node, 'up', q{'live', request => '{"k": "live"}'}),
	replay_row('succeeded', 200, $md5{live}), 'up: live replays the new result');

my $c = claim($node, 'up', q{'ended', request => '{"k": "ended"}', lease => '1 hour'});
is($c->{outcome}, 'claimed', 'up: "ended" is claimed again');
is($c->{attempt}, 2,         'up: as attempt 2');
cmp_ok($c->{token}, '>', $seq, 'up: with a token larger than every token 1.1 issued');
is( sqlstate_of($node, 'up',
		"SELECT idempotency.idem_finish('ended', $token{ended}, 500)"),
	'55006', 'up: the dead token of attempt 1 is refused (55006)');
is( sqlstate_of($node, 'up',
		"SELECT idempotency.idem_finish('ended', $c->{token}, 200, $body{ended})"),
	'00000', 'up: the token of attempt 2 finishes "ended"');
is_deeply(claim($node, 'up', q{'ended', request => '{"k": "ended"}'}),
	replay_row('succeeded', 200, $md5{ended}), 'up: "ended" replays the new result');

# =========================================================================
# Updated from 1.1 or from 1.0, the catalog is a fresh 1.2 install's
# =========================================================================
sql('postgres', 'CREATE DATABASE fresh');
sql('fresh', "CREATE EXTENSION idempotency VERSION '1.2'");
is(ext_state('fresh'), '1.2|t', 'fresh: 1.2 is installed');
sql('postgres', 'CREATE DATABASE from_1_0');
sql('from_1_0', "CREATE EXTENSION idempotency VERSION '1.0'");
is(sqlstate_of($node, 'from_1_0', "ALTER EXTENSION idempotency UPDATE TO '1.2'"), '00000',
	'from_1_0: one ALTER EXTENSION updates 1.0 to 1.2');
is(ext_state('from_1_0'), '1.2|t', 'from_1_0: 1.2');

my %catalog = catalog_queries();
foreach my $what (sort keys %catalog)
{
	my $fresh = sql('fresh', $catalog{$what});
	isnt($fresh, '', "fresh: $what: the query finds something");
	is(sql('up', $catalog{$what}), $fresh, "1.1 updated = fresh: $what");
	is(sql('from_1_0', $catalog{$what}), $fresh, "1.0 updated = fresh: $what");
}
like(sql('fresh', $catalog{'functions (definition, owner, privileges)'}),
	qr/FUNCTION idempotency\.idem_version\(\)\n RETURNS text\n LANGUAGE c\n STABLE PARALLEL SAFE\nAS '\$libdir\/idempotency', \$function\$idem_version\$function\$\nowner postgres, acl default\n/,
	'fresh: idem_version() is C, STABLE, PARALLEL SAFE, default privileges');
like(sql('fresh', $catalog{'extension members'}),
	qr/^function idempotency\.idem_version\(\)$/m,
	'fresh: idem_version() is a member of the extension');

# =========================================================================
# Privileges an administrator set on idem_claim carry over
# =========================================================================
my $acl_sql = "SELECT proacl FROM pg_proc WHERE oid = '$CLAIM_SIG'::regprocedure";
sql('postgres', "CREATE ROLE regress_lead; CREATE ROLE regress_worker; "
	  . 'CREATE ROLE "Regress App"');
foreach my $from ('1.0', '1.1')
{
	(my $db = "acl_$from") =~ s/\./_/;
	sql('postgres', "CREATE DATABASE $db");
	sql($db, "CREATE EXTENSION idempotency VERSION '$from'");
	grant_claim_per_role($node, $db);
	my $acl = sql($db, $acl_sql);
	like($acl, qr/regress_worker=X\/regress_lead/,
		"$db: under $from, regress_lead granted EXECUTE to regress_worker");

	is(sqlstate_of($node, $db, "ALTER EXTENSION idempotency UPDATE TO '1.2'"), '00000',
		"$db: the update to 1.2 succeeds");
	is(sql($db, $acl_sql), $acl, "$db: idem_claim has the same privileges, grantors and order");
	is( sql($db,
			"SELECT count(*) FROM pg_init_privs WHERE objoid = '$CLAIM_SIG'::regprocedure"),
		'0', "$db: they are the administrator's, not the extension's initial privileges");
	is(stale_initacl_deps($node, $db), '',
		"$db: no role dependency of initial privileges outlives them");
	revoke_claim_per_role($node, $db);
}
my ($state, $out, $err) = sql_result($node, 'postgres', "DROP ROLE $granted_roles");
is($state, '00000', 'with their grants revoked, the granted roles can be dropped')
  or diag($err);

# =========================================================================
# PostgreSQL 17+: the update repairs what the first 1.0 to 1.1 script left
# =========================================================================
SKIP:
{
	my $version_num = sql('postgres', 'SHOW server_version_num');
	skip 'PostgreSQL before 17 records no role dependencies of initial privileges '
	  . "(pg_shdepend deptype 'i'): nothing to repair on $version_num", 9
	  if $version_num < 170000;

	# A 1.0 database with the administrator's grants, updated to 1.1.  The
	# update's grants record initial privileges and, with them, a role
	# dependency on each role they name; an event trigger keeps a copy of
	# those rows as each grant left them, before the script removes them.
	sql('postgres', 'CREATE DATABASE stale');
	sql('stale', "CREATE EXTENSION idempotency VERSION '1.0'");
	sql('postgres', "CREATE ROLE regress_lead; CREATE ROLE regress_worker; "
		  . 'CREATE ROLE "Regress App"');
	grant_claim_per_role($node, 'stale');
	sql('stale', q{
CREATE TABLE public.initacl_deps AS SELECT * FROM pg_shdepend WHERE false;
CREATE FUNCTION public.keep_initacl_deps() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
	INSERT INTO public.initacl_deps
	SELECT * FROM pg_shdepend
	 WHERE deptype = 'i' AND classid = 'pg_proc'::regclass
	   AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database());
END
$$;
CREATE EVENT TRIGGER keep_initacl_deps ON ddl_command_end WHEN TAG IN ('GRANT')
	EXECUTE FUNCTION public.keep_initacl_deps();
});
	is(sqlstate_of($node, 'stale', "ALTER EXTENSION idempotency UPDATE TO '1.1'"),
		'00000', 'stale: updated to 1.1');
	sql('stale', 'DROP EVENT TRIGGER keep_initacl_deps');
	is(stale_initacl_deps($node, 'stale'), '',
		'stale: the 1.0 to 1.1 update leaves no role dependency of initial privileges');
	is( sql('stale',
			    "SELECT string_agg(DISTINCT refobjid::regrole::text, ', ') "
			  . "FROM public.initacl_deps WHERE objid = '$CLAIM_SIG'::regprocedure"),
		'"Regress App", regress_lead, regress_worker',
		'stale: its grants recorded a role dependency on each granted role');

	# What the first release of the script left behind.
	sql('stale',
		'INSERT INTO pg_shdepend SELECT DISTINCT * FROM public.initacl_deps; '
		  . 'DROP TABLE public.initacl_deps; DROP FUNCTION public.keep_initacl_deps()');
	like(
		stale_initacl_deps($node, 'stale'),
		qr/\A(function idempotency\.idem_claim\(.*\) -> .+\n?){3}\z/,
		'stale: three role dependencies of idem_claim without initial privileges');
	revoke_claim_per_role($node, 'stale');
	($state, $out, $err) = sql_result($node, 'stale', "DROP ROLE $granted_roles");
	is($state, '2BP01', 'stale: they keep DROP ROLE failing after the grants are revoked');
	like($err, qr/initial privileges for function idempotency\.idem_claim/,
		'stale: the error names idem_claim\'s initial privileges');

	is(sqlstate_of($node, 'stale', "ALTER EXTENSION idempotency UPDATE TO '1.2'"),
		'00000', 'stale: updated to 1.2');
	is(stale_initacl_deps($node, 'stale'), '',
		'stale: the update removed the role dependencies without initial privileges');
	($state, $out, $err) = sql_result($node, 'stale', "DROP ROLE $granted_roles");
	is($state, '00000', 'stale: now the roles can be dropped') or diag($err);
}

$node->stop;
done_testing();
